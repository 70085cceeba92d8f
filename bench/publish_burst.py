"""The server telling a whole fleet at once: N retained per-device tasks published through the server's MQTT
client (``server.mqtt.MqttLink``) into the embedded broker, as the final step tells every enrolled device, then
the retained round announcement. Side by side: with the client's acknowledgement window (the default) and
without it (a window larger than N). paho numbers QoS 1 messages 1..65,535, so without the window every task
past that is refused ("Message queue full"): the 100,000-device run lost 34,023 tasks and its announcement so.

    .venv/bin/python bench/publish_burst.py --messages 100000

Reports, per variant, the publishes refused, the seconds until the broker holds every retained message, and
the most messages unacknowledged at once. Results: bench/results/publish_burst.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pfl_edge.protocol import round_topic, task_topic
from server.broker import EmbeddedBroker
from server.mqtt import WINDOW, MqttLink

TASK = b'{"federation":"fleet","round":3,"kind":"final","base":"' + b"0" * 64 + b'"}'


class _Refusals(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.n = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "failed" in record.getMessage():
            self.n += 1


def burst(n: int, window: int, wait_s: float) -> dict[str, Any]:
    refusals = _Refusals()
    logging.getLogger("server.mqtt").addHandler(refusals)
    with EmbeddedBroker() as broker:
        link = MqttLink(broker.url, lambda _t, _p: None, window=window)
        link.start()
        t0 = time.perf_counter()
        for i in range(n):
            link.publish_raw(task_topic("fleet", f"dev-{i:06d}"), TASK, retain=True)
        link.publish_raw(round_topic("fleet"), b'{"state":"finished"}', retain=True)
        published_s = time.perf_counter() - t0
        deadline = time.monotonic() + wait_s
        while len(broker.core.retained) < n + 1 - refusals.n and time.monotonic() < deadline:
            time.sleep(0.2)  # a benchmark watching a count, not a test
        held = len(broker.core.retained)
        announced = round_topic("fleet") in broker.core.retained
        total_s = time.perf_counter() - t0
        link.stop()
    logging.getLogger("server.mqtt").removeHandler(refusals)
    return {"window": window, "messages": n + 1, "refused": refusals.n, "retained_held": held,
            "announcement_held": announced, "publish_s": round(published_s, 2),
            "until_held_s": round(total_s, 2), "most_unacked": link.most_unacked}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--wait-s", type=float, default=600.0)
    ap.add_argument("--out", default="bench/results/publish_burst.json")
    args = ap.parse_args()
    runs = []
    for window in (WINDOW, args.messages * 2):
        r = burst(args.messages, window, args.wait_s)
        print(json.dumps(r), flush=True)
        runs.append(r)
    out = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": f"{os.cpu_count()} CPUs",
           "load_average_after": os.getloadavg(), "args": vars(args), "runs": runs}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
