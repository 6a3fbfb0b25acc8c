"""math-verify in its own process, so its signal.alarm timeouts run in a main thread and a
hang can be cut off by the parent (`cleaner_jax.rewards.math.MathVerifier`).

Protocol: length-prefixed JSON on stdin/stdout; request {"pred": str, "gold": str}, reply
{"equal": bool} or {"error": "<ExcType>: message"}.
"""
from __future__ import annotations

import os

from cleaner_jax.tools.framing import recv_msg, send_msg


def main() -> None:
    resp_fd = os.dup(1)
    os.dup2(2, 1)  # math-verify/sympy warnings must not corrupt the protocol
    from math_verify import parse, verify

    send_msg(resp_fd, {"ready": True})
    while True:
        try:
            req = recv_msg(0)
        except EOFError:
            return
        try:
            gold = parse("\\boxed{" + req["gold"] + "}")
            pred = parse("\\boxed{" + req["pred"] + "}")
            send_msg(resp_fd, {"equal": bool(verify(gold, pred))})
        except Exception as e:  # math-verify's own timeout or a parser bug on this input
            send_msg(resp_fd, {"error": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    main()
