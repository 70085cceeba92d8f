"""The container's HEALTHCHECK (Dockerfile): healthy when the server's ``/healthz`` answers 200 with the database
and the MQTT link both up. Python's standard library only (the slim image has no curl).

The URL: ``HEALTHCHECK_URL`` if set, else ``http://127.0.0.1:8080/healthz`` (``https://`` when ``PFL_TLS_CERT`` is
set). HTTPS is not verified: the probe talks to its own container over loopback, and the certificate names the
public host, not 127.0.0.1. Exit status 0: healthy; 1: not (the reason on stderr).
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import urllib.request

TIMEOUT_S = 4.0
MAX_BYTES = 4096  # /healthz is a few dozen bytes: read no more than this


def url() -> str:
    if os.environ.get("HEALTHCHECK_URL"):
        return os.environ["HEALTHCHECK_URL"]
    scheme = "https" if os.environ.get("PFL_TLS_CERT") else "http"
    return f"{scheme}://127.0.0.1:8080/healthz"


def main() -> int:
    target = url()
    ctx = ssl._create_unverified_context() if target.startswith("https") else None
    try:
        with urllib.request.urlopen(target, timeout=TIMEOUT_S, context=ctx) as r:
            body = json.loads(r.read(MAX_BYTES))
    except (OSError, ValueError) as e:
        print(f"healthcheck: {target}: {e}", file=sys.stderr)
        return 1
    if not isinstance(body, dict) or body.get("database") is not True or body.get("mqtt") is not True:
        print(f"healthcheck: {target}: not healthy: {body}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
