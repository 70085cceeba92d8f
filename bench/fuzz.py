"""Long fuzzing runs of what the tests fuzz briefly: the property-based fuzzer on ``pfl_edge.codec.decode``
(``tests/pfl_edge/test_codec_property.py``) and schemathesis over the server's OpenAPI
(``tests/server/test_openapi_fuzz.py``), each with many more examples. Results: ``bench/results/fuzz.json``.

    python bench/fuzz.py                       # ~10 minutes on 2 cores
    python bench/fuzz.py --codec 2000 --api 20 # a quick look

Anything found belongs in a regression test (``tests/pfl_edge/test_codec_hostile.py``,
``tests/server/test_hostile.py``) with its fix; the failing example is in the run's log (``--log``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RUNS = {
    "codec": ("tests/pfl_edge/test_codec_property.py", "PFL_CODEC_FUZZ_EXAMPLES"),
    "api": ("tests/server/test_openapi_fuzz.py", "PFL_FUZZ_EXAMPLES"),
}


def run(name: str, examples: int, log: Path) -> dict[str, Any]:
    """One pytest run of ``name``'s fuzz tests with ``examples`` examples per test; its outcome."""
    path, env_var = RUNS[name]
    junit = log.with_suffix(f".{name}.xml")
    env = {**os.environ, env_var: str(examples), "PYTHONHASHSEED": "0"}
    t0 = time.perf_counter()
    with log.open("a") as out:
        out.write(f"\n===== {name}: {examples} examples per test =====\n")
        out.flush()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path,
                               f"--junitxml={junit}"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    failures = [f"{case.get('name')}: {(case[0].get('message') or '')[:300]}"
                for case in suite.iter("testcase") if len(case) and case[0].tag in ("failure", "error")]
    junit.unlink()
    tests = int(suite.get("tests", 0))
    return {"file": path, "examples_per_test": examples, "tests": tests, "examples_total_at_most": tests * examples,
            "failed": len(failures), "failures": failures, "wall_s": round(wall, 1), "exit_code": proc.returncode}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--codec", type=int, default=20_000, help="examples per codec fuzz test (3 tests)")
    ap.add_argument("--api", type=int, default=150, help="examples per operation and caller (schemathesis)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/fuzz.json")
    ap.add_argument("--log", type=Path, default=Path("/tmp/pfl-fuzz.log"))
    args = ap.parse_args(argv)
    args.log.write_text("")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    results = {"codec": run("codec", args.codec, args.log), "api": run("api", args.api, args.log)}
    report = {"commit": commit, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
              **results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0 if all(r["failed"] == 0 and r["exit_code"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
