"""One benchmark system in its own process, stepped by the driver over a pipe.

    python -m marl_llm.bench.worker <system> '<workload json>'

Protocol (one JSON object per line on the original stdout; everything the libraries print goes
to stderr): {"event": "ready", "build_seconds", "peak_rss_gib"} once built; then for every
"step" line on stdin {"event": "step", "seconds", "tokens", "rollout_seconds", "peak_rss_gib"};
"quit" (or end of input) exits. A failure answers {"event": "error",
"message"} and exits 1; a missing peer package says how to install it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback


def main(argv: list[str]) -> int:
    name, workload_json = argv[0], argv[1]
    # The protocol keeps the real stdout; library prints (tqdm, trl, comlrl) go to stderr.
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def say(event: str, **fields) -> None:
        channel.write(json.dumps({"event": event, **fields}) + "\n")

    try:
        from marl_llm.bench.systems import registry
        from marl_llm.bench.workload import Workload, peak_rss_gib

        t0 = time.perf_counter()
        system = registry()[name](Workload.from_json(workload_json))
        say("ready", build_seconds=time.perf_counter() - t0, peak_rss_gib=peak_rss_gib())
        for line in sys.stdin:
            command = line.split()
            if not command or command[0] == "quit":
                break
            if command[0] == "step":
                stats = system.step()
                say("step", **dataclasses.asdict(stats), peak_rss_gib=peak_rss_gib())
        return 0
    except ModuleNotFoundError as err:
        say("error", message=f"{name}: {err}: install the benchmark extra: pip install -e '.[bench]'")
        return 1
    except Exception as err:  # the driver reports it and goes on with the other systems
        traceback.print_exc()
        say("error", message=f"{name}: {type(err).__name__}: {err}")
        return 1
    finally:
        close = getattr(locals().get("system"), "close", None)
        if close:
            close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
