"""Answers the course's tours hold back until the reader asks for them.

A tour asks a question ("where does overlap stop helping?"); Run All must not print the
answer before the reader has tried. ``check`` reads the reader's own settings or answer and
says whether it holds, with a hint, never the answer itself; ``answer`` says it outright.

>>> from labkit import course
>>> course.check("bubble", dash)            # is the dashboard's last run under 20% bubble?
>>> course.check("bucket", dash, answer=1)  # "overlap stops helping from 1 MiB buckets"?
>>> course.answer("bucket", dash)
"""
from __future__ import annotations

MiB = 1024 * 1024


def check(question: str, dash, answer=None) -> str:
    """Judge the reader's settings (``"bubble"``) or ``answer`` (``"bucket"``); print and return it."""
    checks = {"bubble": _check_bubble, "bucket": _check_bucket}
    if question not in checks:
        raise ValueError(f"question={question!r} is unknown; use one of {sorted(checks)}")
    text = checks[question](dash, answer)
    print(text)
    return text


def answer(question: str, dash) -> str:
    """The answer, for a reader who asks for it."""
    if question == "bucket":
        total = gradient_bytes(dash.model) / MiB
        text = (f"Overlap stops helping once one bucket holds every gradient: bucket_mb ≥ {total:.2f} MiB "
                f"(this model's gradients). That bucket fills only when backward has finished, so it "
                f"cannot leave any earlier than bucketed's does.")
    elif question == "bubble":
        text = ("GPipe idles (p−1)/(m+p−1) of the step: with p = 2 that is below 20% from m = 5 on "
                "(1/6 ≈ 17%), as long as each micro-batch's compute dominates its fixed costs.")
    else:
        raise ValueError(f"question={question!r} is unknown; use 'bubble' or 'bucket'")
    print(text)
    return text


def gradient_bytes(model) -> int:
    """Bytes of gradients one replica of ``model`` (a module or a zero-argument factory) averages."""
    built = model() if callable(model) and not hasattr(model, "parameters") else model
    return sum(p.numel() * p.element_size() for p in built.parameters() if p.requires_grad)


def _check_bubble(dash, _answer) -> str:
    live = dash.wait()
    if live is None or live.state != "done":
        return "no finished run yet: press Run (or wait for the one in flight) and check again"
    s, bubble = live.spec.strategy, live.run.metrics.get("bubble_fraction", float("nan"))
    where = f"run {live.number}: pp={s.pp} {s.schedule}, microbatches={s.microbatches}, bubble {bubble:.0%}"
    if s.pp < 2:
        return f"{where}. Not a pipeline yet: set dp = 1 and pp = 2."
    if bubble < 0.2:
        return f"{where}. Goal reached (< 20%)."
    return f"{where}. Not yet: more micro-batches shorten the fill and drain relative to the step."


def _check_bucket(dash, answer) -> str:
    if answer is None:
        return ("Make a guess first: the bucket size (MiB) from which overlap no longer beats bucketed, "
                "then run course.check('bucket', dash, answer=<MiB>).")
    from .parallel.data.sync import make_buckets

    built = dash.model() if callable(dash.model) and not hasattr(dash.model, "parameters") else dash.model
    params = [(n, p) for n, p in built.named_parameters() if p.requires_grad]
    buckets = len(make_buckets(params, float(answer) * MiB))
    if buckets == 1:
        return (f"Right: with {answer:g} MiB buckets all gradients go in one bucket, which can only "
                f"leave when backward is done, so overlap has nothing left to hide.")
    return (f"Not there yet: {answer:g} MiB buckets make {buckets} buckets; the first leaves while backward "
            f"still runs on earlier layers, so overlap can still hide it. Try larger.")
