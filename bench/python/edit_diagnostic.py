#!/usr/bin/env python3
"""How good are the hindsight teacher's edits (`distill_target = "edit"`)?

Reads a learning-curve log written with
`RUST_LOG=...,hindsight_learner::trainer=debug` and scores, per logged field, the trainer's
decision against what the simulated user's critique says. The critique (`rule-and-value`
style, noise 0) names every wrong field and the value it should have ("So the department is
retention.", "That makes it high priority.", "That means no refund."), and never a right one,
so from the log alone:
  - a field is *criticized* when the critique states a value for it;
  - detection: the trainer flags a field when the feedback's shift of its logged value is
    below -margin; recall = criticized fields flagged, false alarms = uncriticized flagged;
  - edits: an edited value is right when it equals the stated value (criticized fields) or
    the logged value (uncriticized ones; any change there is an error).
With `min_target_logprob`, targets below the floor are reported apart (trained on or not).
With a frozen teacher the trainer caches its edits (`teacher_cache_examples`): a replayed
example is logged once, when its edit is made, so the counts here are per example, not per step.
With `distill_target = "teacher"` the log has the teacher's own answers instead ("The
teacher's own answer."); those are scored whole, against the correction when the feedback
carries one ("A correct answer would be: {...}"), else the critique's stated values over the
logged answer.
Own answers are also ranked by the teacher's confidence, once per measure the log carries
(`per_field=`: over the vocabulary; `decision=`: each decoding choice among the tokens the
grammar allowed, the trainer's `confidence = "decision"`): whole answers (the sum over fields)
and, per field, values with a correction, values the critique states and values it does not
mention. With FIELD_FLOOR=<nats> in the environment: how many values a `min_field_logprob` at
that floor keeps and masks, and how many of each are right.
Usage: [FIELD_FLOOR=-2.5] edit_diagnostic.py LOG [MARGIN=0.5]
"""
import os
import re
import sys

FIELD_FLOOR = float(os.environ["FIELD_FLOOR"]) if os.environ.get("FIELD_FLOOR") else None
ANSI = re.compile(r"\x1b\[[0-9;]*m")
STATED = [
    ("department", re.compile(r"So the department is (\w+)\.|It has to go to (\w+)\.")),
    ("priority", re.compile(r"So priority should be (\w+)\.|That makes it (\w+) priority\.")),
    ("refund", re.compile(r"So the refund is (\w+)\.|That means (?:a )?(\w+) refund\.|That means (no) refund\.")),
]


def stated_values(feedback):
    out = {}
    for field, rx in STATED:
        m = rx.search(feedback)
        if m:
            v = next(g for g in m.groups() if g)
            out[field] = "none" if v == "no" else v
    return out


def main():
    path = sys.argv[1]
    margin = float(sys.argv[2]) if len(sys.argv) > 2 else 0.5
    shifts_rx = re.compile(r'\("(\w+)", (-?[\d.e-]+)\)')
    examples = []  # one per training example with feedback, in log order
    own = []  # (own answer, truth) per teacher's own answer (distill_target = "teacher")
    for raw in open(path, errors="replace"):
        line = ANSI.sub("", raw)
        rec = re.search(r"record=(\S+)", line)
        if "How the feedback shifts" in line:
            logged = dict(re.findall(r'"(\w+)": "(\w+)"', re.search(r"logged=(\{.*?\})", line).group(1)))
            shifts = {k: float(v) for k, v in shifts_rx.findall(line)}
            fb = re.search(r'feedback="(.*)"', line)
            examples.append({"rec": rec.group(1), "logged": logged, "shifts": shifts,
                             "stated": stated_values(fb.group(1) if fb else ""),
                             "edited": None, "kept": True})
        elif "The teacher's own answer." in line:
            fields = lambda key: dict(re.findall(r'"(\w+)": ?"(\w+)"', re.search(key + r"=(\{.*?\})", line).group(1)))
            fb = re.search(r'feedback="(.*)"', line)
            fb = fb.group(1).replace('\\"', '"') if fb else ""
            corr = re.search(r"A correct answer would be: (\{.*?\})", fb)
            truth = (dict(re.findall(r'"(\w+)": ?"(\w+)"', corr.group(1))) if corr
                     else {**fields("logged"), **stated_values(fb)})
            measures = {}
            for key, name in (("per_field", "vocabulary"), ("decision", "decision")):
                m = re.search(key + r"=\[(.*?)\]", line)
                if m:
                    measures[name] = {k: float(v) for k, v in shifts_rx.findall(m.group(1))}
            own.append((fields("own"), truth, bool(corr), measures,
                        set(stated_values(fb)) if not corr else None))
        elif "teacher's edit of the logged answer" in line and examples:
            examples[-1]["edited"] = dict(re.findall(r'"(\w+)": "(\w+)"', re.search(r"edited=(\{.*?\})", line).group(1)))
        elif "below the confidence floor" in line and examples and rec and examples[-1]["rec"] == rec.group(1):
            # min_target_logprob: this target was not trained on.
            examples[-1]["kept"] = False
    if own:
        whole = sum(o == t for o, t, *_ in own)
        right = sum(o.get(k) == v for o, t, *_ in own for k, v in t.items())
        n = sum(len(t) for _, t, *_ in own)
        print(f"teacher's own answers: {len(own)}; fields right {right}/{n} ({100 * right / max(1, n):.0f}%), "
              f"whole answers right {whole} ({100 * whole / len(own):.0f}%)")
        own_calibration(own)
    if not examples:
        return
    rows = [list(finish(e, margin)) for e in examples]
    report([r for ex in rows for r in ex], margin)
    dropped = sum(not e["kept"] for e in examples)
    if dropped:
        print(f"\nbelow the confidence floor: {dropped} of {len(examples)} targets "
              f"({100 * dropped / len(examples):.0f}%) not trained on")
        for name, keep in (("targets trained on", True), ("targets dropped", False)):
            group = [r for r, e in zip(rows, examples) if e["kept"] == keep]
            whole = sum(all(ok for *_, ok in r) for r in group)
            fields = [ok for r in group for *_, ok in r]
            print(f"  {name}: {len(group)}, fields right {100 * sum(fields) / max(1, len(fields)):.0f}%, "
                  f"whole targets right {whole} ({100 * whole / max(1, len(group)):.0f}%)")
    whole = sum(all(ok for *_, ok in r) for r in rows)
    print(f"whole targets right (all fields as the critique implies): {whole}/{len(rows)} "
          f"({100 * whole / max(1, len(rows)):.0f}%)")


def own_calibration(own):
    for measure in ("vocabulary", "decision"):
        group = [(o, t, corr, m[measure], stated) for o, t, corr, m, stated in own if measure in m]
        if group:
            print(f"confidence over the {measure}:" if measure == "vocabulary"
                  else "confidence of the decisions (among the tokens the grammar allowed):")
            calibration(group)


def calibration(own):
    """How well the teacher's confidence in its own answer (the joint log-prob of its field
    values, what `min_target_logprob` filters on) tells right answers from wrong ones: the
    most confident 100/75/50/25%, with and without a correction in the feedback."""
    scored = sorted(((sum(pf.values()), o == t, corr) for o, t, corr, pf, _ in own), reverse=True)
    ranked("confidence, all", scored)
    ranked("confidence, with a correction", [x for x in scored if x[2]])
    ranked("confidence, critique only", [x for x in scored if not x[2]])
    # Per field (`per_field=`, what `min_field_logprob` filters on): a value is right when it
    # equals the truth; critique-only values split by whether the critique states the field.
    values = [(lp, o.get(k) == t.get(k), corr, stated is not None and k in stated)
              for o, t, corr, per_field, stated in own for k, lp in per_field.items()]
    ranked("per field, with a correction", sorted([v for v in values if v[2]], reverse=True))
    ranked("per field, values the critique states",
           sorted([v for v in values if not v[2] and v[3]], reverse=True))
    ranked("per field, values the critique does not mention",
           sorted([v for v in values if not v[2] and not v[3]], reverse=True))
    if FIELD_FLOOR is not None:
        for name, keep in (("kept", True), ("masked", False)):
            group = [v for v in values if (v[0] >= FIELD_FLOOR) == keep]
            print(f"  values {name} at min_field_logprob {FIELD_FLOOR}: {len(group)}, right {sum(v[1] for v in group)}")


def ranked(name, group):
    """The most confident 100/75/50/25% of `group` (sorted, most confident first; each item
    starts with (confidence, right)): the floor that keeps them and how many are right."""
    if not group:
        return
    parts = []
    for share in (1.0, 0.75, 0.5, 0.25):
        top = group[:max(1, round(share * len(group)))]
        parts.append(f"top {int(share * 100)}%: floor {top[-1][0]:.2f}, right {sum(r[1] for r in top)}/{len(top)}")
    print(f"  {name} ({len(group)}): " + "; ".join(parts))


def finish(e, margin):
    logged, shifts, stated, edited = e["logged"], e["shifts"], e["stated"], e["edited"]
    for field, shift in shifts.items():
        flagged = shift < -margin
        value = edited.get(field) if edited else None
        truth = stated.get(field) if field in stated else logged.get(field)
        ok = (value if value is not None else logged.get(field)) == truth
        yield (field, field in stated, shift, flagged, logged.get(field), value, stated.get(field), ok)


def report(rows, margin):
    crit = [r for r in rows if r[1]]
    unc = [r for r in rows if not r[1]]
    n = len(rows)
    print(f"{n} logged fields in {n // 3} training steps with feedback; margin {margin} nats")
    def med(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] if xs else float("nan")
    print(f"criticized fields: {len(crit)}, median shift {med([r[2] for r in crit]):+.2f}; "
          f"flagged {sum(r[3] for r in crit)} ({100 * sum(r[3] for r in crit) / max(1, len(crit)):.0f}%)")
    print(f"uncriticized fields: {len(unc)}, median shift {med([r[2] for r in unc]):+.2f}; "
          f"flagged {sum(r[3] for r in unc)} ({100 * sum(r[3] for r in unc) / max(1, len(unc)):.0f}%)")
    # What the target ends up with, per field, against the critique.
    right = wrong = 0
    edited_right = edited_wrong = 0
    for field, criticized, shift, flagged, logged, edited, stated, _ in rows:
        value = edited if edited is not None else logged
        truth = stated if criticized else logged
        ok = value == truth
        right += ok
        wrong += not ok
        if edited is not None and edited != logged:
            edited_right += ok
            edited_wrong += not ok
    print(f"target fields right: {right}/{right + wrong} ({100 * right / max(1, right + wrong):.0f}%); "
          f"logged answers' fields right: {len(unc)}/{n} ({100 * len(unc) / max(1, n):.0f}%)")
    print(f"changed values: {edited_right + edited_wrong}, right {edited_right}, wrong {edited_wrong}")
    for name, group in (("criticized", crit), ("uncriticized", unc)):
        ok = sum((r[5] if r[5] is not None else r[4]) == (r[6] if r[1] else r[4]) for r in group)
        print(f"  target right on {name} fields: {ok}/{len(group)} ({100 * ok / max(1, len(group)):.0f}%)")
    for field in ("department", "priority", "refund"):
        fr = [r for r in rows if r[0] == field]
        c = [r for r in fr if r[1]]
        u = [r for r in fr if not r[1]]
        print(f"  {field:10s}: criticized {len(c):3d} flagged {sum(r[3] for r in c):3d} | "
              f"uncriticized {len(u):3d} flagged {sum(r[3] for r in u):3d}")
    # Detection at other margins.
    for m in (0.0, 0.25, 0.5, 1.0, 1.5, 2.0):
        tp = sum(r[2] < -m for r in crit)
        fp = sum(r[2] < -m for r in unc)
        print(f"  margin {m:4.2f}: recall {100 * tp / max(1, len(crit)):3.0f}%  false alarms {100 * fp / max(1, len(unc)):3.0f}%")


if __name__ == "__main__":
    main()
