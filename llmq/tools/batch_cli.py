"""`llmq batch submit FILE.jsonl [--wait]`: upload, create the batch, poll with a progress bar,
download the output."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import httpx

from llmq.common.store import BATCH_ENDPOINTS

FINAL = {"completed", "failed", "cancelled", "expired"}

# httpx logs every request at INFO: one line per poll would break the progress bar.
logging.getLogger("httpx").setLevel(logging.WARNING)


def _bar(done: int, failed: int, total: int, status: str, width: int = 30) -> str:
    frac = (done + failed) / total if total else 0.0
    filled = int(frac * width)
    return f"\r[{'#' * filled}{'.' * (width - filled)}] {done + failed}/{total} ({failed} failed) {status}   "


def endpoint_of(path: Path) -> str:
    """The endpoint the file's first line names (a batch runs one endpoint); chat if none."""
    with path.open("rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    url = json.loads(raw.decode("utf-8-sig")).get("url")
                except (ValueError, AttributeError):
                    break
                if url in BATCH_ENDPOINTS:
                    return url
                break
    return BATCH_ENDPOINTS[0]


def _get(http: httpx.Client, url: str, attempts: int = 30) -> httpx.Response:
    """A poll that outlives a short outage (an API replica restarting, a network blip): the
    batch runs on the server either way."""
    for attempt in range(attempts):
        try:
            r = http.get(url)
            if r.status_code < 500:
                return r
        except httpx.TransportError:
            if attempt == attempts - 1:
                raise
        time.sleep(min(1.0 + attempt, 5.0))
    return r


def submit(
    path: Path,
    base_url: str,
    api_key: str | None,
    endpoint: str | None,
    wait: bool,
    output: Path | None,
    poll: float = 1.0,
) -> int:
    endpoint = endpoint or endpoint_of(path)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=60) as http:
        with path.open("rb") as f:
            r = http.post("/v1/files", files={"file": (path.name, f)}, data={"purpose": "batch"})
        if r.status_code != 200:
            print(f"upload failed ({r.status_code}): {r.text}", file=sys.stderr)
            return 1
        file_id = r.json()["id"]
        r = http.post(
            "/v1/batches",
            json={"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h"},
        )
        if r.status_code != 200:
            print(f"batch creation failed ({r.status_code}): {r.text}", file=sys.stderr)
            return 1
        batch = r.json()
        print(f"batch {batch['id']} created from {path} ({file_id})")
        if not wait:
            return 0
        while batch["status"] not in FINAL:
            time.sleep(poll)
            r = _get(http, f"/v1/batches/{batch['id']}")
            if r.status_code != 200:
                print(f"\nbatch {batch['id']}: polling failed ({r.status_code}): {r.text}")
                return 1
            batch = r.json()
            c = batch["request_counts"]
            sys.stderr.write(_bar(c["completed"], c["failed"], c["total"], batch["status"]))
            sys.stderr.flush()
        sys.stderr.write("\n")
        c = batch["request_counts"]
        print(
            f"batch {batch['id']} {batch['status']}: {c['completed']} completed, {c['failed']} failed"
        )
        if batch.get("errors"):
            for e in batch["errors"].get("data", []):
                print(f"  line {e.get('line')}: {e.get('message')}", file=sys.stderr)
        out = output or path.with_suffix(".output.jsonl")
        if batch.get("output_file_id"):
            out.write_bytes(_get(http, f"/v1/files/{batch['output_file_id']}/content").content)
            print(f"output: {out}")
        if batch.get("error_file_id"):
            # FILE.output.jsonl -> FILE.errors.jsonl; any other name -> NAME.errors.jsonl
            err = out.with_name(out.name.replace(".output.jsonl", ".errors.jsonl"))
            if err == out:
                err = out.with_suffix(".errors.jsonl")
            err.write_bytes(_get(http, f"/v1/files/{batch['error_file_id']}/content").content)
            print(f"errors: {err}")
        # Completed with every line failed is no success to a script.
        ok = batch["status"] == "completed" and not (c["total"] and c["failed"] == c["total"])
        return 0 if ok else 1
