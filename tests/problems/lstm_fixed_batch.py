"""KernelBench level-3 style LSTM whose initial state is built for one batch size: the reference
itself raises at any other batch size, so those regimes do not apply."""
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self, input_size, hidden_size, num_layers, output_size):
        super().__init__()
        self.register_buffer("h0", torch.randn(num_layers, batch_size, hidden_size))
        self.register_buffer("c0", torch.randn(num_layers, batch_size, hidden_size))
        self.lstm = nn.LSTM(input_size, hidden_size, num_layers, batch_first=True)
        self.fc = nn.Linear(hidden_size, output_size)

    def forward(self, x):
        out, _ = self.lstm(x, (self.h0, self.c0))
        return self.fc(out[:, -1, :])


batch_size = 16
sequence_length = 6
input_size = 8
hidden_size = 12
num_layers = 2
output_size = 5


def get_inputs():
    return [torch.randn(batch_size, sequence_length, input_size)]


def get_init_inputs():
    return [input_size, hidden_size, num_layers, output_size]
