"""problems/oom_reference.py on a device whose memory others held: when the reference is
refused memory (at 16x parameters), 6 GiB of the device were held outside its worker, as
when a candidate takes the device's memory at import while the reference runs. A stand-in on
a CPU: the problem runs in the reference's worker and answers the harness's measure there."""
from pathlib import Path

from fastelbo.harness.guard import reference_tasks
from fastelbo.problems import load_module

_oom = load_module(Path(__file__).with_name("oom_reference.py"))
batch_size, dim, get_inputs, get_init_inputs = (_oom.batch_size, _oom.dim, _oom.get_inputs,
                                                _oom.get_init_inputs)


class Model(_oom.Model):
    def forward(self, x):
        if float(self.lin.weight.abs().max()) > 2.0:  # where oom_reference's is refused
            reference_tasks._held_elsewhere = lambda device: 6 << 30
        return super().forward(x)
