"""A real PACS for the DICOMweb and listener tests and benchmarks/pacs_dicomweb.py: Orthanc (Debian's `orthanc` and
`orthanc-dicomweb`) started as a subprocess with a temporary configuration: temporary storage, free HTTP and DICOM
ports on 127.0.0.1, the DICOMweb plugin, tafl's listener as a modality, no authentication.

`Orthanc.available()` says whether it is installed (tests skip cleanly where it is not; .ci/run installs it)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx

from tests.dicom_net import free_port

PLUGIN = Path("/usr/share/orthanc/plugins/libOrthancDicomWeb.so")


def binary() -> str | None:
    return shutil.which("Orthanc") or next((p for p in ("/usr/sbin/Orthanc", "/usr/bin/Orthanc")
                                            if os.access(p, os.X_OK)), None)


class Orthanc:
    """One Orthanc: `url` (REST), `dicomweb` (its DICOMweb root), `dicom_port` and `aet` (its storage SCP).

    `refuse_stow` installs a Lua filter that answers every STOW-RS with 403 (a PACS that refuses what tafl files); `modalities` maps a name to (AE title, port) on 127.0.0.1 (tafl's listener)."""

    def __init__(self, root: Path, *, modalities: dict[str, tuple[str, int]] | None = None,
                 refuse_stow: bool = False, aet: str = "ORTHANC", users: dict[str, str] | None = None,
                 env: dict[str, str] | None = None):
        self.root, self.aet = Path(root), aet
        self.env = {**os.environ, **env} if env else None  # e.g. DCMTK's TCP_NODELAY for its DICOM sockets
        self.auth = next(iter(users.items())) if users else None  # what this helper's own REST calls log in as
        self.root.mkdir(parents=True, exist_ok=True)
        self.http_port, self.dicom_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.dicomweb = self.url + "/dicom-web"
        self.log = self.root / "orthanc.log"
        self.proc: subprocess.Popen | None = None
        cfg = {
            "Name": "tafl-test", "StorageDirectory": str(self.root / "db"), "IndexDirectory": str(self.root / "db"),
            "HttpPort": self.http_port, "DicomPort": self.dicom_port, "DicomAet": aet,
            "RemoteAccessAllowed": False, "AuthenticationEnabled": bool(users), "RegisteredUsers": users or {},
            "HttpServerEnabled": True,
            "DicomServerEnabled": True, "DicomCheckCalledAETitle": False, "DicomAlwaysAllowStore": True,
            "DicomScuTimeout": 10, "StableAge": 1, "ConcurrentJobs": 1,
            "Plugins": [str(PLUGIN)], "DicomWeb": {"Enable": True, "Root": "/dicom-web/", "EnableWado": True},
            "DicomModalities": {name: [ae, "127.0.0.1", port] for name, (ae, port) in (modalities or {}).items()},
        }
        if refuse_stow:  # a PACS that refuses every STOW-RS with 403 (Lua: Orthanc's own request filter)
            lua = self.root / "refuse_stow.lua"
            lua.write_text("function IncomingHttpRequestFilter(method, uri, ip, username, headers)\n"
                           "  return not (method == 'POST' and string.find(uri, '/dicom%-web/studies') ~= nil)\n"
                           "end\n")
            cfg["LuaScripts"] = [str(lua)]
        self.config = self.root / "orthanc.json"
        self.config.write_text(json.dumps(cfg, indent=1))

    @staticmethod
    def available() -> bool:
        return binary() is not None and PLUGIN.exists()

    def start(self, timeout: float = 60.0) -> Orthanc:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([binary(), str(self.config)], stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"Orthanc exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/system", timeout=2, auth=self.auth).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"Orthanc did not answer within {timeout} s: {self.log.read_text()[-2000:]}")

    def stop(self, kill: bool = False) -> None:
        if getattr(self, "_http", None) is not None:
            self._http.close()
            self._http = None
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.proc = None

    # ------------------------------------------------------------------ REST
    @property
    def http(self) -> httpx.Client:
        """One client for this helper's REST calls: a new one per call costs tens of ms of CPU (its TLS
        context), which a benchmark polling Orthanc would take from what it measures."""
        if getattr(self, "_http", None) is None:
            self._http = httpx.Client(auth=self.auth)
        return self._http

    def get(self, path: str):
        r = self.http.get(self.url + path, timeout=60)
        r.raise_for_status()
        return r.json()

    def post(self, path: str, body) -> httpx.Response:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = self.http.post(self.url + path, content=data, timeout=300)
        r.raise_for_status()
        return r

    def upload(self, data: bytes) -> dict:
        """Store one Part 10 file through the REST API (`POST /instances`)."""
        return self.post("/instances", data).json()

    def instances(self) -> list[str]:
        return self.get("/instances")

    def tags(self, orthanc_id: str) -> dict:
        return self.get(f"/instances/{orthanc_id}/simplified-tags")

    def by_modality(self, modality: str) -> list[dict]:
        """Every instance of that modality, with its simplified tags and Orthanc id (`_id`)."""
        out = []
        for iid in self.instances():
            t = self.tags(iid)
            if t.get("Modality") == modality:
                out.append({**t, "_id": iid})
        return out
