"""Math rewards: the authors' strict boxed-answer rule, and a math-verify equivalence mode.

Strict rule (verl `math_dapo.compute_score(strict_box_verify=True)`, docs/authors.md
§5): take the response's last 100 characters, find the last `\\boxed{` there and its balanced
closing brace; the prediction is the text inside; correct iff it equals the ground truth as a
raw string (no normalisation, no stripping: `025` is not `25`). Score +1 / -1.

Equivalence mode: same extraction (window configurable, the whole response by default), exact
match first, else math-verify's `verify(parse(\\boxed{gold}), parse(\\boxed{pred}))` in a
separate process with a hard deadline (math-verify uses signal.alarm, which fails outside the
main thread and can hang). A verifier timeout or parse error scores -1 (the answer could not be
shown equal, as in the authors' code path); a crashed or unreachable verifier process is an
infra error.
"""
from __future__ import annotations

import json
import logging
import selectors
import subprocess
import sys
import threading
import time

from cleaner_jax.rewards.result import RewardResult
from cleaner_jax.tools.framing import recv_exact, send_msg

log = logging.getLogger(__name__)

STRICT_WINDOW = 100  # characters at the end of the response that may hold the answer
BOX_OPEN = "\\boxed{"


def last_boxed_only_string(text: str) -> str | None:
    """`\\boxed{...}` of the last `\\boxed{` in text, braces balanced; None if absent/unclosed."""
    start = text.rfind(BOX_OPEN)
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
    return None


def extract_boxed(text: str, window: int | None = STRICT_WINDOW) -> str | None:
    """Inner text of the last balanced `\\boxed{}` within the final `window` characters."""
    boxed = last_boxed_only_string(text if window is None else text[-window:])
    return None if boxed is None else boxed[len(BOX_OPEN) : -1]


def strict_box_score(response: str, ground_truth: str) -> RewardResult:
    """The authors' math/GPQA reward: ±1 on an exact string match of the last boxed answer."""
    pred = extract_boxed(response, STRICT_WINDOW)
    if pred is None:
        return RewardResult(score=-1.0, detail=f"no closed \\boxed{{}} in the last "
                            f"{STRICT_WINDOW} characters", acc=False, pred=None)
    if pred == ground_truth:
        return RewardResult(score=1.0, detail="exact match", acc=True, pred=pred)
    return RewardResult(score=-1.0, detail=f"{pred!r} != {ground_truth!r}", acc=False,
                        pred=pred)


class MathVerifier:
    """Equivalence checking with math-verify in worker processes with a hard timeout.

    Thread-safe; one request per worker at a time. A worker that misses the deadline is killed
    and replaced. Use as a context manager (or call close()).
    """

    def __init__(self, workers: int = 1, timeout_s: float = 15.0,
                 window: int | None = None, start_timeout_s: float = 120.0) -> None:
        self.timeout_s = timeout_s
        self.window = window
        self.start_timeout_s = start_timeout_s
        self.replaced_workers = 0
        self._lock = threading.Lock()
        self._idle: list[subprocess.Popen[bytes]] = []
        self._free = threading.Semaphore(workers)
        procs = [self._spawn() for _ in range(workers)]
        try:
            for p in procs:
                self._recv(p, start_timeout_s)
                self._idle.append(p)
        except BaseException:
            for p in procs:
                _kill(p)
            raise

    @staticmethod
    def _spawn() -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-m", "cleaner_jax.rewards._math_verify_worker"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    @staticmethod
    def _recv(p: subprocess.Popen[bytes], timeout_s: float) -> dict:
        assert p.stdout is not None
        fd = p.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            if not sel.select(timeout=timeout_s):
                raise TimeoutError(f"math-verify worker gave no answer in {timeout_s}s")
        n = int.from_bytes(recv_exact(fd, 4), "big")
        return json.loads(recv_exact(fd, n))

    def equivalent(self, pred: str, gold: str) -> tuple[bool | None, str]:
        """(True/False, detail), or (None, detail) when the verifier process failed."""
        self._free.acquire()
        with self._lock:
            p = self._idle.pop()
        try:
            assert p.stdin is not None
            t0 = time.perf_counter()
            send_msg(p.stdin.fileno(), {"pred": pred, "gold": gold})
            reply = self._recv(p, self.timeout_s)
        except TimeoutError:
            p = self._replace(p, "timeout")
            return False, f"math-verify gave no verdict in {self.timeout_s}s"
        except (OSError, EOFError, ValueError) as e:
            p = self._replace(p, repr(e))
            return None, f"math-verify worker failed: {e!r}"
        finally:
            with self._lock:
                self._idle.append(p)
            self._free.release()
        if "error" in reply:
            return False, f"math-verify error: {reply['error']}"
        return bool(reply["equal"]), f"math-verify {'equal' if reply['equal'] else 'different'}" \
            f" ({time.perf_counter() - t0:.2f}s)"

    def _replace(self, p: subprocess.Popen[bytes], why: str) -> subprocess.Popen[bytes]:
        log.warning("math-verify worker replaced: %s", why)
        _kill(p)
        self.replaced_workers += 1
        new = self._spawn()
        self._recv(new, self.start_timeout_s)
        return new

    def score(self, response: str, ground_truth: str) -> RewardResult:
        pred = extract_boxed(response, self.window)
        if pred is None:
            return RewardResult(score=-1.0, detail="no closed \\boxed{}", pred=None)
        if pred == ground_truth:
            return RewardResult(score=1.0, detail="exact match", acc=True, pred=pred)
        equal, detail = self.equivalent(pred, ground_truth)
        if equal is None:
            return RewardResult.infra(detail, pred=pred)
        return RewardResult(score=1.0 if equal else -1.0, detail=detail, acc=equal, pred=pred)

    def close(self) -> None:
        with self._lock:
            procs, self._idle = self._idle, []
        for p in procs:
            _kill(p)

    def __enter__(self) -> MathVerifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _kill(p: subprocess.Popen[bytes]) -> None:
    p.kill()
    p.wait()
    for f in (p.stdin, p.stdout):
        if f is not None:
            f.close()
