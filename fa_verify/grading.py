"""`fa_verify check TARGET --grading`: check with a profile of settings for kernel-generation
pipelines, and a versioned JSON verdict (docs/grading.md).

Grading is `check` with: a seed drawn at run time and printed only after the verdict; the
frameworks' attention, softmax and matmul entry points forbidden (`fa_verify.guards`, unless
--forbid says otherwise); a time budget (--budget) under which a search stops drawing; and a
verdict that fails closed: a property the budget cut short before it judged `MIN_JUDGED`
examples (or its --max-examples, if fewer), or never started, is not passed. The document is
check's --json document (`targets[0]`), re-keyed by property, with the format version.
"""

from __future__ import annotations

from fa_verify.guards import BLIND_SPOTS

#: The format of the grading document; bumped when a key changes meaning or goes away.
FORMAT = "fa_verify-grading/1"
#: Examples a property the budget cut short must have judged to count (fewer max examples: those).
MIN_JUDGED = 5
#: What a numpy target is, for the guards' part of the document.
NUMPY_NOTE = "numpy is not a framework here: numpy targets are reference models, nothing of numpy is forbidden"


def judged_enough(prop: dict, max_examples: int) -> bool:
    """Whether a property's search (check's JSON of it) judged enough to count under grading."""
    if prop["status"] == "not applicable":
        return not prop["budget_spent"]  # not applicable by nature counts neither way; not run fails
    return not prop["budget_spent"] or prop["examples"] >= min(MIN_JUDGED, max_examples)


def _power(prop: dict) -> str | None:
    """The null-model guard's power statement: which trivial outputs the tolerance rejected."""
    if prop["informative"] is None:
        return None
    if not prop["null_rejected"]:
        return "no trivial output was rejected: a pass says nothing about the target"
    rejected = ", ".join(f"{name} ({count})" for name, count in prop["null_rejected"].items())
    return (f"on {prop['informative']} informative examples the tolerance rejected these trivial outputs "
            f"(examples): {rejected}; {prop['uninformative']} uninformative examples counted neither way")


def document(check_document: dict, *, budget: float | None, forbid: tuple, max_examples: int) -> dict:
    """The grading document from check's --json document of one target."""
    target = check_document["targets"][0] if check_document["targets"] else None
    properties, short = {}, []
    for prop in target["properties"] if target else ():
        enough = judged_enough(prop, max_examples)
        if not enough:
            short.append(prop["property"])
        properties[prop["property"]] = {
            "status": prop["status"], "examples": prop["examples"], "seconds": prop["seconds"],
            "judged_enough": enough, "budget_spent": prop["budget_spent"],
            "reason": prop["reason"] or None,
            "minimal_failing_case": prop["failure"], "other_failures": prop["other_failures"],
            "reproducer": prop["reproducer"],
            "null_model": {"informative": prop["informative"], "uninformative": prop["uninformative"],
                           "rejected": prop["null_rejected"], "power": _power(prop)},
            "worst_ratio": prop["worst_ratio"], "notes": prop["notes"]}
    examples = target["examples"] if target else 0
    seconds = target["seconds"] if target else 0.0
    passed = bool(check_document["passed"] and target and target["checked"] and not short)
    spent = any(p["budget_spent"] for p in properties.values())
    return {
        "format": FORMAT,
        "passed": passed,
        "target": target["backend"] if target else None,
        "seed": check_document["seed"],
        "seed_drawn": check_document["seed_drawn"],
        "properties": properties,
        "not_judged_enough": short,
        "budget": {"seconds": budget, "spent": spent,
                   "stopped": [name for name, p in properties.items() if p["budget_spent"]],
                   "min_judged": MIN_JUDGED},
        "guards": {"forbid": list(forbid), "blind_spots": list(BLIND_SPOTS), "numpy": NUMPY_NOTE},
        "timings": {"seconds": seconds, "per_property": {name: p["seconds"] for name, p in properties.items()}},
        "throughput": round(examples / seconds, 3) if seconds else None,
        "examples": examples,
        "check": check_document,
        **({"error": check_document["error"]} if "error" in check_document else {}),
    }


def verdict_line(grading: dict) -> str:
    """The one line printed (stderr) before the seed."""
    counts = {}
    for prop in grading["properties"].values():
        counts[prop["status"]] = counts.get(prop["status"], 0) + 1
    words = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    short = f"; not judged enough: {', '.join(grading['not_judged_enough'])}" if grading["not_judged_enough"] else ""
    spent = "; budget spent" if grading["budget"]["spent"] else ""
    return (f"GRADE {'PASS' if grading['passed'] else 'FAIL'} {grading['target']}: {words or 'nothing checked'}; "
            f"{grading['examples']} examples, {grading['throughput'] or 0:g} examples/s{spent}{short}")
