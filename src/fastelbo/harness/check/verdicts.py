"""The second half of a check: the candidate's worker replays every regime, and its verdicts.

`Verdicts` is check._Check's (which inherits it): its inputs handed to the candidate's worker (a
copy in its own directory, or a device-resident regime's shared inputs), the candidate's records
checked for shape before anything reads them (judge.record_problem), each regime judged, here or
by the reference's worker where the regime is device-resident (judge_pass, once per regime), and
the trials that missed the plain tolerance rejudged against the perturbed-reference envelope. It
reads the check's state as _Check keeps it: its options (`o`), `report`, `root`, `meta`,
`resident`, `pairs`, `ref_w`, `cand` and `sha256`, and `_planned` (and the `skipped` it sets),
`_entry`, `_init_file` and `_worker`. Nothing here imports torch at import (a new `fastelbo
check` forks its workers first).
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .. import refcache
from ..guard import handoff
from ..guard.supervisor import Worker
from ..judge import (
    ENVELOPE_CATEGORIES,
    denial,
    denied_by_others,
    judge_trial,
    record_problem,
    regime_of,
    trial_from_dict,
)
from ..report import (
    CANDIDATE_FAILURES,
    CheckReport,
    Finding,
    RegimeReport,
    TrialReport,
    kernelbench_note,
)
from ..task_specs import check_candidate, envelope_pass, judge_pass


class NoRoom(Exception):
    """The candidate worker's own directory could not take a file the harness hands it."""


PERTURB_RUNS = 16  # compare.PERTURB_RUNS (compare imports torch; tests hold the two equal)


class Verdicts:
    """The check's verdicts, for check._Check (module docstring)."""

    def _judge(self, cand_w: Worker) -> CheckReport:
        o, report = self.o, self.report
        planned = self._planned()
        report.skipped = [f"{name}: {why}" for name, why in self.skipped]
        entries, tasks, lost = self._handed(cand_w, planned)
        if lost is not None:
            return report.error("reference", f"the reference cache lost regime "
                                f"{lost}'s entry under {self.root} while checking; run again")
        default = entries["default"][3]
        report.kernelbench = kernelbench_note(default["trials"], o.eval_mode)
        t0 = time.monotonic()
        judging = ThreadPoolExecutor(1)  # the reference's worker judges while the candidate runs
        verdicts = {}

        def judge(partial) -> None:  # a resident regime's result has arrived
            g = entries.get(regime_of(partial), (None,))[0]
            # Once per regime: its task writes one record of it. Records handed over again
            # queued a judge each, and the check waited for them all, past --timeout (red team,
            # 2026-12-05: 200 copies, 50 s under a 20 s limit); a second one is malformed below.
            if g is not None and g.name in self.resident and g.name not in verdicts \
                    and self._malformed(partial, entries) is None and partial["trials"]:
                verdicts[g.name] = judging.submit(
                    self.ref_w.run, judge_pass,
                    {"name": g.name, "trials": partial["trials"],
                     "envelope": g.perturbed_reference, "atol": o.atol, "rtol": o.rtol,
                     "outputs_dir": str(cand_w.tmp)},
                    timeout=o.timeout)
        try:
            out = cand_w.run(check_candidate,
                             {"candidate": str(self.cand), "device": o.device, "seed": o.seed,
                              "eval_mode": o.eval_mode,
                              "init_file": self._hand(cand_w, self._init_file(), "init.pt"),
                              "regimes": tasks, "sha256": self.sha256},
                             timeout=o.timeout, forward_timeout=o.forward_timeout,
                             build_timeout=o.build_timeout, on_partial=judge)
            verdicts = {name: f.result() for name, f in verdicts.items()}
        finally:
            judging.shutdown(wait=True)
        report.timings["candidate_s"] = time.monotonic() - t0
        got, malformed = {}, {}
        for p in out.partials:  # the candidate's to forge: checked before anything reads them
            why = self._malformed(p, entries)
            if why is None and p["name"] in got:
                why = (f"the candidate's worker handed over a second record of regime "
                       f"{p['name']}, which its task writes once: a forged record")
            if why is None:
                got[p["name"]] = p
            else:
                malformed.setdefault(regime_of(p) if regime_of(p) in entries else "default", why)
        report.weights = next((p["weights"] for p in got.values() if p["weights"]), "")
        failed_in = None if out.ok else next((t["name"] for t in tasks if t["name"] not in got),
                                             None)
        unjudged = []
        for name, (g, _, _, entry) in entries.items():
            judged = verdicts.get(name)
            if judged is not None and not judged.ok:  # this regime only: others still count
                why = f"the reference's worker could not judge it: {judged.reason}"
                report.regimes.append(self._regime(g, entry, None, True, why))
                unjudged.append((name, why, judged.output_tail))
                continue
            regime = self._regime(g, entry, got.get(name), name == failed_in, out.reason,
                                  judged and judged.result, out.ok)
            if name in malformed:  # whatever else it sent: its worker lied
                regime.status = "FAIL"
                t = len(regime.trials)
                seed = entry["trials"][min(t, len(entry["trials"]) - 1)]["seed"] \
                    if entry["trials"] else o.seed
                regime.trials.append(TrialReport(t, seed, False, findings=[
                    Finding("malformed", malformed[name])]))
            report.regimes.append(regime)
        self._envelopes(entries)
        for name, why, tail in unjudged if out.ok else ():
            report.error("reference", f"regime {name}: {why}", tail)
        if not out.ok:
            return report.error(out.category, f"candidate worker: {out.reason}",
                                out.output_tail, allowed=CANDIDATE_FAILURES)
        return report.finish()

    def _handed(self, cand_w: Worker, planned) -> tuple[dict, list, str | None]:
        """(entries {regime: (regime, cache key, its files or None, its reference entry)}, the
        candidate's task of each regime it can be judged in, the regime whose cache entry was
        lost meanwhile or None): each regime's inputs handed to the candidate's worker, copied
        into its directory, or shared where the reference's worker keeps them."""
        entries, tasks = {}, []
        for g, key in planned:
            task = {"name": g.name, "scale": g.scale}
            if g.name in self.resident:  # kept by the reference's worker, inputs shared
                files, entry = None, self.resident[g.name]["entry"]
                task["shared_inputs"] = [[self._hand_shared(cand_w, d) for d in trial]
                                         for trial in self.resident[g.name]["inputs"]]
            else:
                files = self._entry(key)
                if files is None:
                    return entries, tasks, g.name
                entry = refcache.load(files[1])
                task["inputs"] = self._hand(cand_w, files[0], f"regime{len(entries)}.inputs.pt")
            entry["trials"] = entry["trials"][:self.o.trials]
            entries[g.name] = (g, key, files, entry)
            if entry["applicable"] and all(t["deterministic"] for t in entry["trials"]):
                tasks.append({**task, "seeds": [t["seed"] for t in entry["trials"]]})
        return entries, tasks, None

    def _malformed(self, partial, entries: dict) -> str | None:
        """Why a regime's record from the candidate's worker is not one its task writes
        (judge.record_problem), or None."""
        name = regime_of(partial)
        if name not in entries:
            return "the candidate's worker handed over a record naming no regime it was sent"
        why = record_problem(partial, entries[name][3]["trials"], name in self.resident)
        return None if why is None else f"the candidate's worker handed over a record of " \
            f"regime {name} that its task does not write ({why}): a forged record"

    @staticmethod
    def _hand(worker: Worker, source, name: str) -> str:
        """A copy of the reference's file `source` in the candidate worker's own directory: the
        only place it may read the reference's inputs from (never the cache itself), as a new
        file: never written through anything the candidate put there (handoff.py). NoRoom
        where that directory cannot take it (its file system full)."""
        try:
            return str(handoff.write_new(worker.tmp, name, source=source))
        except OSError as exc:
            raise NoRoom(f"the candidate's worker could not be handed its inputs ({name}) in "
                          f"its own directory: {exc.strerror or exc}") from None

    def _hand_shared(self, worker: Worker, desc):
        """A device-resident input as the candidate's worker can open it: CUDA IPC handles as
        they are; a tensor shared through a file of the reference's worker (the CPU), copied."""
        from ..guard import shared  # imports torch: not before the workers are forked
        if not shared.is_shared(desc) or "path" not in desc:
            return desc
        name = f"input-{Path(desc['path']).name}"
        return {**desc, "path": self._hand(worker, desc["path"], name)}

    def _regime(self, g, entry: dict, got: dict | None, failed: bool, why: str,
                judged: dict | None = None, finished: bool = False) -> RegimeReport:
        """The regime's report; `judged`: the verdicts of its trials from judge_pass (a
        device-resident regime), else they are judged here. `finished`: the candidate's worker
        said its task was done, so every trial of every regime sent must have its answer (or
        the exception that stopped it): a regime or trial without one is wrong ("unanswered"),
        not merely not run. Only code in the candidate's process can end the task early so
        (the worker's own loop answers every trial): it did no work that can be judged."""
        o = self.o
        regime = RegimeReport(g.name, g.batch_size or self.meta["default_batch"], g.scale,
                              g.variant, envelope_runs=_runs(g))
        if not entry["applicable"]:
            regime.status, regime.note = "N/A", entry["reason"]
            if entry.get("exhausted"):
                self._starved(regime, entry)
            return regime
        nondet = [t["determinism_note"] for t in entry["trials"] if not t["deterministic"]]
        if nondet:
            regime.status = "REF-NONDET"
            regime.note = ("the reference gives different outputs for identical seeds, so the "
                           f"candidate cannot be judged here: {nondet[0]}")
            return regime
        regime.note = entry.get("note", "")
        if got is None:
            regime.status = "ERROR" if failed else "NOT RUN"
            regime.note = why if failed else regime.note
            if finished:
                regime.trials.append(_unanswered(0, entry))
            return regime
        ref_trials, cand_trials = entry["trials"], got["trials"]
        if judged is not None:
            regime.trials = [trial_from_dict(d) for d in judged["trials"]]
            if judged["fragile"] and regime.note:
                regime.note += (f", {judged['fragile']} fragile (finite in only some perturbed "
                                "runs) excluded")
        for t, (rt, ct) in enumerate(zip(ref_trials, cand_trials) if judged is None else ()):
            prev = (ref_trials[t - 1], cand_trials[t - 1]) if t else None
            regime.trials.append(judge_trial(t, rt, ct, prev, o.atol, o.rtol))
            self.pairs[(g.name, t)] = (rt, ct, prev)
        if got["error"] is not None:
            t = len(cand_trials)
            regime.trials.append(TrialReport(
                t, ref_trials[min(t, len(ref_trials) - 1)]["seed"], False,
                findings=[Finding("exception", f"the candidate raised in {got['error']['where']}"
                                               f":\n{got['error']['message']}")]))
            regime.status = "ERROR"
        elif len(cand_trials) < len(ref_trials):
            regime.status = "INCOMPLETE"
            if finished:
                regime.trials.append(_unanswered(len(cand_trials), entry))
        else:
            regime.status = "PASS" if all(t.passed for t in regime.trials) else "FAIL"
        return regime

    def _starved(self, regime: RegimeReport, entry: dict) -> None:
        """The reference was refused memory in `regime` (never cached: the next check tries
        again). Where that was for memory held outside the reference's worker (the refusal's
        own numbers: judge.denied_by_others), even with the candidate's worker ended
        (_alone), that is another process's doing: the regime cannot be judged, and a check
        that skipped it is no pass."""
        regime.note += "; not cached (it depends on what else held the memory)"
        denied = (entry.get("requested"), entry.get("free"), entry.get("held_elsewhere"))
        if not denied_by_others(*denied):
            return
        regime.status = "ERROR"
        self.report.failures.append(Finding(
            "reference_starved", f"regime {regime.name}: {denial(*denied)}: it cannot be "
                                 "judged there; rerun on a device no other process uses"))

    def _envelopes(self, entries: dict) -> None:
        """Rejudge, against the perturbed-reference envelope, every trial of a scaled regime
        that missed the plain tolerance; compute only the envelopes not cached yet."""
        need = [(regime, trial) for regime in self.report.regimes if regime.envelope_runs
                for trial in regime.trials if (regime.name, trial.index) in self.pairs
                and any(f.category in ENVELOPE_CATEGORIES for f in trial.findings)]
        if not need:
            return
        t0 = time.monotonic()
        files = {(r.name, t.index): refcache.path(self.root, entries[r.name][1],
                                                  f"env{t.index}.pt") for r, t in need}
        missing: dict[str, dict] = {}
        for (name, t), f in files.items():
            if not f.is_file():
                g, _, (inputs, ref), _ = entries[name]
                req = missing.setdefault(name, {"regime": g.to_dict(), "inputs": str(inputs),
                                                "ref": str(ref), "trials": {}})
                req["trials"][str(t)] = str(f)
        skip: dict[str, list[int]] = {}
        while missing:
            o = self.o
            alive = self.ref_w is not None and self.ref_w.proc.poll() is None
            worker = self.ref_w if alive else self._worker("envelope")
            out = worker.run(
                envelope_pass,
                {"problem": str(self.prob), "device": o.device, "seed": o.seed,
                 "eval_mode": o.eval_mode, "init_file": self._init_file(),
                 "requests": list(missing.values()), "skip": skip}, timeout=o.timeout)
            if not out.ok:
                self.report.error("reference", "the perturbed-reference envelope could not be "
                                  f"computed: {out.reason}", out.output_tail)
                return
            lost = out.result.get("lost")
            if lost is None:
                break
            # A perturbed run raised and left the worker's device unusable (a CUDA device
            # assert): that run is left out, and a fresh worker computes what is missing.
            skip.setdefault(f"{lost['regime']}/{lost['trial']}", []).append(lost["run"])
            self.report.notes.append(
                f"perturbed reference run {lost['run']} of regime {lost['regime']}, trial "
                f"{lost['trial']} left its worker's device unusable; its envelope leaves it out")
            worker.kill()
            self.ref_w = None
            missing = {name: {**req, "trials": {t: f for t, f in req["trials"].items()
                                                if not Path(f).is_file()}}
                       for name, req in missing.items()}
            missing = {name: req for name, req in missing.items() if req["trials"]}
        fragile_seen: dict[str, int] = {}
        for regime, trial in need:
            env = refcache.load(files[(regime.name, trial.index)])
            rt, ct, prev = self.pairs[(regime.name, trial.index)]
            new = judge_trial(trial.index, rt, ct, prev, self.o.atol, self.o.rtol, env)
            regime.trials[trial.index] = new
            fragile_seen[regime.name] = fragile_seen.get(regime.name, 0) + sum(
                int(m.sum()) for m in env["fragile"] if m is not None)
        for regime in self.report.regimes:
            if regime.name in fragile_seen:
                if regime.status in ("PASS", "FAIL"):
                    regime.status = "PASS" if all(t.passed for t in regime.trials) else "FAIL"
                if regime.note:
                    regime.note += (f", {fragile_seen[regime.name]} fragile (finite in only "
                                    "some perturbed runs) excluded")
        self.report.timings["envelope_s"] = time.monotonic() - t0


def _unanswered(t: int, entry: dict) -> TrialReport:
    """Trial `t` of a regime that the candidate's finished task left without an answer."""
    seed = entry["trials"][min(t, len(entry["trials"]) - 1)]["seed"]
    return TrialReport(t, seed, False, findings=[Finding(
        "unanswered", f"the candidate's worker ended its task without answering trial {t} of "
                      f"this regime (only code in the candidate's process ends it early)")])


def _runs(g) -> int:
    return PERTURB_RUNS if g.perturbed_reference else 0
