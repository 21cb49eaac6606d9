"""`llmq batch submit FILE.jsonl [--wait]`: upload, create the batch, poll with a progress bar,
download the output."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import httpx

from llmq.common.storage.store import BATCH_ENDPOINTS, FINAL_STATES


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
    """Upload ``path``, create its batch and, with ``wait``, follow it and download its output;
    the exit status: 0 for a batch created (or completed, with ``wait``), else 1."""
    # httpx logs every request at INFO: one line per poll would break the progress bar.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    endpoint = endpoint or endpoint_of(path)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=60) as http:
        batch = _create(http, path, endpoint)
        if batch is None:
            return 1
        if not wait:
            return 0
        batch = _follow(http, batch, poll)
        if batch is None:
            return 1
        return _finish(http, batch, output or path.with_suffix(".output.jsonl"))


def _create(http: httpx.Client, path: Path, endpoint: str) -> dict | None:
    """Upload the file and create its batch; None, once said why, when either is refused."""
    with path.open("rb") as f:
        r = http.post("/v1/files", files={"file": (path.name, f)}, data={"purpose": "batch"})
    if r.status_code != 200:
        print(f"upload failed ({r.status_code}): {r.text}", file=sys.stderr)
        return None
    file_id = r.json()["id"]
    r = http.post(
        "/v1/batches",
        json={"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h"},
    )
    if r.status_code != 200:
        print(f"batch creation failed ({r.status_code}): {r.text}", file=sys.stderr)
        return None
    batch = r.json()
    print(f"batch {batch['id']} created from {path} ({file_id})")
    return batch


def _follow(http: httpx.Client, batch: dict, poll: float) -> dict | None:
    """Poll until the batch is final, with a progress bar on stderr; None if a poll failed."""
    while batch["status"] not in FINAL_STATES:
        time.sleep(poll)
        r = _get(http, f"/v1/batches/{batch['id']}")
        if r.status_code != 200:
            print(f"\nbatch {batch['id']}: polling failed ({r.status_code}): {r.text}")
            return None
        batch = r.json()
        c = batch["request_counts"]
        sys.stderr.write(_bar(c["completed"], c["failed"], c["total"], batch["status"]))
        sys.stderr.flush()
    sys.stderr.write("\n")
    return batch


def _finish(http: httpx.Client, batch: dict, out: Path) -> int:
    """Say how the batch ended, download its output and error files; the exit status."""
    c = batch["request_counts"]
    print(
        f"batch {batch['id']} {batch['status']}: {c['completed']} completed, {c['failed']} failed"
    )
    if batch.get("errors"):
        for e in batch["errors"].get("data", []):
            print(f"  line {e.get('line')}: {e.get('message')}", file=sys.stderr)
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
