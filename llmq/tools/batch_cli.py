"""`llmq batch submit FILE.jsonl [--wait]`: upload, create the batch, poll with a progress bar,
download the output."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import httpx

FINAL = {"completed", "failed", "cancelled", "expired"}

# httpx logs every request at INFO: one line per poll would break the progress bar.
logging.getLogger("httpx").setLevel(logging.WARNING)


def _bar(done: int, failed: int, total: int, status: str, width: int = 30) -> str:
    frac = (done + failed) / total if total else 0.0
    filled = int(frac * width)
    return f"\r[{'#' * filled}{'.' * (width - filled)}] {done + failed}/{total} ({failed} failed) {status}   "


def submit(
    path: Path,
    base_url: str,
    api_key: str | None,
    endpoint: str,
    wait: bool,
    output: Path | None,
    poll: float = 1.0,
) -> int:
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
            batch = http.get(f"/v1/batches/{batch['id']}").json()
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
            out.write_bytes(http.get(f"/v1/files/{batch['output_file_id']}/content").content)
            print(f"output: {out}")
        if batch.get("error_file_id"):
            # FILE.output.jsonl -> FILE.errors.jsonl; any other name -> NAME.errors.jsonl
            err = out.with_name(out.name.replace(".output.jsonl", ".errors.jsonl"))
            if err == out:
                err = out.with_suffix(".errors.jsonl")
            err.write_bytes(http.get(f"/v1/files/{batch['error_file_id']}/content").content)
            print(f"errors: {err}")
        return 0 if batch["status"] == "completed" else 1
