"""The one schema of a check's result: `fastelbo check --json`, the Python API and the MCP tools.

`CHECK_REPORT` is a JSON Schema (draft 2020-12) of `CheckReport.to_dict()`; tests validate
reports against it. The output is strict JSON: a non-finite float (a difference beyond float64's
range) is written as the string "inf", "-inf" or "nan".

Top level
    schema        "fastelbo.check/4" (/3 until 2026-12-05: /4 adds the categories
                  `unanswered`, `malformed` and `reference_starved`, and a failure's category
                  is a run failure's alone; a report of /4 can fail /3's schema, so the id
                  changed with it)
    device        where the check ran: cpu, cuda or cuda:N (without a device given, cuda where
                  torch sees a GPU); "" when it stopped before choosing one (a syntax error)
    seed          the seed of weights, inputs and forwards; seed_source secret (drawn for this
                  check, the default) | given (seed= / --seed, which reproduces a run)
    confinement   what bounded the candidate's worker: landlock | user | none (sandbox.py)
    notes         one line each: the confinement, cache entries repaired, processes the
                  candidate left running and the check killed
    scan          the static scan's flags (scan.py), each {line, category, text}: reported,
                  never a verdict
    status        pass | incorrect | error, with exit_code 0 | 1 | 2 (report.py: a wrong trial
                  makes it 1 even when another regime could not run)
    categories    every finding category met, wrong answers first; reasons: one line each
    failures      what could not run, in order (build, reference, crash, timeout), with messages
    mode          train (modules as constructed, as KernelBench) | eval (--eval-mode)
    reseeding     what the harness does with the generators before each forward
    kernelbench   what KernelBench's own eval would conclude about this pair
    regimes       per regime: status PASS | FAIL | ERROR | N/A | REF-NONDET | NOT RUN | INCOMPLETE,
                  its batch size, parameter scale, input variant, note, and per trial its seed,
                  verdict, findings, and per output max_abs / max_rel / n_bad / n_envelope
                  (max_rel: |diff| / |reference| over the elements where |reference| > atol,
                  0 when there are none; n_envelope, summed per trial as ill_conditioned: the
                  elements outside allclose accepted through the perturbed-reference envelope)
    compile_errors  compiler diagnostics mapped to candidate lines (a failed build)
    reference     cached | computed | partly cached ("" when it never ran)
    timings       seconds: build_s, reference_s, candidate_s, envelope_s (when needed), total_s
    workers       each worker process the check used: role (candidate, reference, envelope),
                  pid, forked (a fork of a new `fastelbo check` that had imported torch, not a
                  new interpreter), prestarted (a started spare of a Session's pool), warm (its
                  start-up, importing torch and creating a CUDA context, was done when its
                  first task came) and startup_s (how long that task waited for it; null: it
                  never began)
"""
from __future__ import annotations

from .report import RUN_FAILURES, SCHEMA_ID, WRONG

CATEGORIES = list(dict.fromkeys(RUN_FAILURES + WRONG))
_NUMBER = {"oneOf": [{"type": "number"}, {"enum": ["inf", "-inf", "nan"]}]}
_FINDING = {"type": "object", "additionalProperties": False,
            "required": ["category", "message"],
            "properties": {"category": {"enum": CATEGORIES}, "message": {"type": "string"}}}
_FAILURE = {**_FINDING, "properties": {**_FINDING["properties"],
                                      "category": {"enum": list(RUN_FAILURES)}}}
_DIFF = {"type": "object", "additionalProperties": False,
         "required": ["index", "ok", "max_abs", "max_rel", "n_bad", "n_envelope", "message"],
         "properties": {"index": {"type": "integer"}, "ok": {"type": "boolean"},
                        "max_abs": _NUMBER, "max_rel": _NUMBER,
                        "n_bad": {"type": "integer", "minimum": 0},
                        "n_envelope": {"type": "integer", "minimum": 0},
                        "message": {"type": "string"}}}
_TRIAL = {"type": "object", "additionalProperties": False,
          "required": ["index", "seed", "passed", "diffs", "findings", "ill_conditioned",
                       "envelope"],
          "properties": {"index": {"type": "integer", "minimum": 0},
                         "seed": {"type": "integer"}, "passed": {"type": "boolean"},
                         "diffs": {"type": "array", "items": _DIFF},
                         "findings": {"type": "array", "items": _FINDING},
                         "ill_conditioned": {"type": "integer", "minimum": 0},
                         "envelope": {"type": "boolean"}}}
_REGIME = {"type": "object", "additionalProperties": False,
           "required": ["name", "batch_size", "scale", "variant", "status", "note", "trials",
                        "envelope_runs"],
           "properties": {"name": {"type": "string"},
                          "batch_size": {"type": ["integer", "null"]},
                          "scale": {"type": "number"}, "variant": {"type": ["string", "null"]},
                          "status": {"enum": ["PASS", "FAIL", "ERROR", "N/A", "REF-NONDET",
                                              "NOT RUN", "INCOMPLETE"]},
                          "note": {"type": "string"},
                          "trials": {"type": "array", "items": _TRIAL},
                          "envelope_runs": {"type": "integer", "minimum": 0}}}
_COMPILE_ERROR = {"type": "object", "additionalProperties": False,
                  "required": ["file", "line", "message", "generated", "generated_line"],
                  "properties": {"file": {"type": "string"},
                                 "line": {"type": ["integer", "null"]},
                                 "message": {"type": "string"},
                                 "generated": {"type": "string"},
                                 "generated_line": {"type": ["integer", "null"]}}}
_STRINGS = {"type": "array", "items": {"type": "string"}}
_SCAN = {"type": "object", "additionalProperties": False,
         "required": ["line", "category", "text"],
         "properties": {"line": {"type": "integer"}, "category": {"type": "string"},
                        "text": {"type": "string"}}}
_WORKER = {"type": "object", "additionalProperties": False,
           "required": ["role", "pid", "forked", "prestarted", "warm", "startup_s",
                        "confinement", "killed"],
           "properties": {"role": {"enum": ["candidate", "reference", "envelope"]},
                          "pid": {"type": "integer"}, "forked": {"type": "boolean"},
                          "prestarted": {"type": "boolean"},
                          "warm": {"type": "boolean"},
                          "startup_s": {"type": ["number", "null"], "minimum": 0},
                          "confinement": {"enum": ["landlock", "user", "none"]},
                          "killed": _STRINGS}}

CHECK_REPORT = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://fastelbo.dev/schema/check-4.json",
    "title": "fastelbo check report",
    "type": "object",
    "additionalProperties": False,
    "required": ["schema", "problem", "candidate", "device", "atol", "rtol", "trials", "seed",
                 "seed_source", "confinement", "notes", "scan", "mode",
                 "reseeding", "kernelbench", "weights", "status", "exit_code", "reasons",
                 "categories", "failures", "regimes", "skipped", "compile_errors", "reference",
                 "timings", "workers", "output_tail"],
    "properties": {
        "schema": {"const": SCHEMA_ID},
        "seed": {"type": "integer", "minimum": 0},
        "seed_source": {"enum": ["secret", "given"]},
        "confinement": {"enum": ["landlock", "user", "none"]},
        "notes": _STRINGS, "scan": {"type": "array", "items": _SCAN},
        "problem": {"type": "string"}, "candidate": {"type": "string"},
        "device": {"type": "string"},
        "atol": {"type": "number", "minimum": 0}, "rtol": {"type": "number", "minimum": 0},
        "trials": {"type": "integer", "minimum": 1},
        "mode": {"enum": ["train", "eval"]},
        "reseeding": {"type": "string"}, "kernelbench": {"type": "string"},
        "weights": {"type": "string"},
        "status": {"enum": ["pass", "incorrect", "error"]},
        "exit_code": {"enum": [0, 1, 2]},
        "reasons": _STRINGS,
        "categories": {"type": "array", "items": {"enum": CATEGORIES}},
        "failures": {"type": "array", "items": _FAILURE},
        "regimes": {"type": "array", "items": _REGIME},
        "skipped": _STRINGS,
        "compile_errors": {"type": "array", "items": _COMPILE_ERROR},
        "reference": {"enum": ["", "cached", "computed", "partly cached"]},
        "timings": {"type": "object", "additionalProperties": {"type": "number"},
                    "propertyNames": {"enum": ["build_s", "reference_s", "candidate_s",
                                               "envelope_s", "total_s"]}},
        "workers": {"type": "array", "items": _WORKER},
        "output_tail": {"type": "string"},
    },
}
