#!/usr/bin/env python3
"""The GPU kit's judgements that are more than a grep, in one place with tests of their own (`--self-test`, run by
CI): whether two runs agree (`same`), and the report's verdict (`verdict`).

  kit_checks.py same LOG BOUND   # prints the figures, then a detail line; exit 0 when the runs agree
  kit_checks.py --self-test      # each judgement on cases it must pass and cases it must fail
"""

import sys


def _runs(text):
    """The two runs of a step's log, split at its `---` line."""
    first, _, second = text.partition("\n---\n")
    return first, second


def _values(run, keys):
    out = {}
    for line in run.splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key in keys:
            out[key] = value
    return out


def same(text, bound):
    """Whether the two runs of `text` agree: their `final_loss`/`accuracy` within `bound` (relative); with no bound,
    the same weights bit for bit (their `weights_digest` present and equal), since the printed losses show only six
    decimals. Returns (passed, figures, detail)."""
    first, second = _runs(text)
    a, b = (_values(r, ("final_loss", "accuracy")) for r in (first, second))
    figures = "first=%s;second=%s;" % (
        ",".join(f"{k}={v}" for k, v in a.items()),
        ",".join(f"{k}={v}" for k, v in b.items()),
    )
    if not a or a.keys() != b.keys():
        return False, figures, f"the runs printed different values: {a} vs {b}"
    close = all(abs(float(a[k]) - float(b[k])) <= bound * abs(float(a[k])) for k in a)
    if not close:
        return False, figures, f"the runs differ beyond {bound} (relative): {a} vs {b}"
    if bound > 0:
        return True, figures, f"within {bound} (relative)"
    da, db = (_values(r, ("weights_digest",)).get("weights_digest") for r in (first, second))
    figures += f"first_digest={da};second_digest={db};"
    if da is None or da != db:
        return False, figures, f"the weights differ bit for bit ({da} vs {db})"
    return True, figures, "the same weights, bit for bit"


def verdict(steps, on_gpu, optional=()):
    """The report's verdict and the steps that did not run: a failed step fails it, and on a GPU machine so does a
    GPU step that did not run, or a step skipped for a tool the machine lacks (no Vulkan), unless `optional`
    names it."""
    unrun = [
        s["step"]
        for s in steps
        if on_gpu
        and s["status"] == "skip"
        and s["step"] not in optional
        and (s["kind"] == "gpu" or (s["kind"] == "vulkan" and s["detail"].startswith("no Vulkan")))
    ]
    failed = any(s["status"] == "fail" for s in steps)
    return ("fail" if failed or unrun else "pass"), unrun


def self_test():
    run = lambda loss, digest: f"final_loss={loss}\naccuracy=0.5\n" + (f"weights_digest={digest}\n" if digest else "")
    cases = [
        # (log, bound, expected)
        (run("0.123456", "ab") + "---\n" + run("0.123456", "ab"), 0, True),
        # The same printed loss, other weights: what six decimals would have hidden.
        (run("0.123456", "ab") + "---\n" + run("0.123456", "cd"), 0, False),
        # No digest: bit for bit cannot be claimed.
        (run("0.123456", None) + "---\n" + run("0.123456", None), 0, False),
        (run("0.123456", "ab") + "---\n" + run("0.123457", "ab"), 0, False),
        (run("0.123456", None) + "---\n" + run("0.123500", None), 1e-3, True),
        (run("0.123456", None) + "---\n" + run("0.200000", None), 1e-3, False),
        ("final_loss=1\n---\n", 0, False),
    ]
    problems = []
    for log, bound, expected in cases:
        got = same(log, bound)[0]
        if got != expected:
            problems.append(f"same(bound {bound}) gave {got} for {log!r}")
    step = lambda name, kind, status, detail="": {"step": name, "kind": kind, "status": status, "detail": detail}
    vulkan_missing = step("quicktour-vulkan", "vulkan", "skip", "no Vulkan: no ICD")
    for steps, on_gpu, optional, expected in [
        ([step("a", "gpu", "pass")], True, (), "pass"),
        ([step("a", "gpu", "pass"), vulkan_missing], True, (), "fail"),
        ([step("a", "gpu", "pass"), vulkan_missing], True, ("quicktour-vulkan",), "pass"),
        ([step("a", "gpu", "skip", "not run: budget")], True, (), "fail"),
        ([step("a", "gpu", "skip", "no GPU: none"), step("v", "vulkan", "skip", "no GPU: none")], False, (), "pass"),
        ([step("c", "cpu", "fail")], False, (), "fail"),
    ]:
        got = verdict(steps, on_gpu, optional)[0]
        if got != expected:
            problems.append(f"verdict({steps}, on_gpu={on_gpu}, optional={optional}) gave {got}")
    for p in problems:
        print(f"kit_checks self-test: {p}", file=sys.stderr)
    if not problems:
        print(f"kit_checks self-test: {len(cases) + 6} cases ok")
    return 1 if problems else 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-test"]:
        sys.exit(self_test())
    if len(sys.argv) == 4 and sys.argv[1] == "same":
        passed, figures, detail = same(open(sys.argv[2], errors="replace").read(), float(sys.argv[3]))
        print(figures)
        print(detail)
        sys.exit(0 if passed else 1)
    print(__doc__, file=sys.stderr)
    sys.exit(2)
