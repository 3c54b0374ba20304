"""One figure of a benchmark run, as scripts/bench.sh collects them into
bench/results/latest.json: a value, the reference measured in the same run,
their ratio, the target and whether it was met."""

from typing import Optional


def figure(name, value, unit, ref_name, ref_value, target="", note="", *,
           met: Optional[bool] = None):
    """A target of the form ">= 3" or "<= 1.2" is checked against the ratio
    unless `met` is given (targets on the value itself, such as "<= 10 ms")."""
    ratio = value / ref_value if ref_value else None
    if met is None and ratio is not None and target:
        if target.startswith(">="):
            met = ratio >= float(target[3:])
        elif target.startswith("<="):
            met = ratio <= float(target[3:])
    d = {"name": name, "value": value, "unit": unit, "reference_name": ref_name,
         "reference_value": ref_value, "ratio": ratio, "target": target or None, "met": met}
    if note:
        d["note"] = note
    return d
