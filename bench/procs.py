"""The processes of a benchmark, on loopback: each started with its stderr in
a log file, its URL read from its "listening on" line (a router prints its
internal listener's URL before, "internal API on ..."), all stopped together."""

import json
import os
import subprocess
import threading
import time
import urllib.request


class Procs:
    def __init__(self, logs, log_prefix=""):
        self.logs = logs
        self.log_prefix = log_prefix
        self.procs = []
        # The internal URL of the last process that printed one (a router).
        self.internal = ""

    def start(self, name, argv, env=None):
        """Starts `argv`; returns the process and the URL it listens on."""
        log = open(os.path.join(self.logs, f"{self.log_prefix}{name}.log"), "w")
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env={**os.environ, "CONNEX_LOG": "warn", **(env or {})},
        )
        self.procs.append(proc)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if "internal API on " in line:
                self.internal = line.split("internal API on ", 1)[1].strip()
            if "listening on " in line:
                # The rest of stdout is drained so that the process never blocks.
                threading.Thread(target=proc.stdout.read, daemon=True).start()
                return proc, line.split("listening on ", 1)[1].strip()
        raise RuntimeError(f"{name} did not start; see {log.name}")

    def wait_ready(self, count, token="bench"):
        """Waits until `count` instances are ready on the router at `self.internal`."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            req = urllib.request.Request(
                f"{self.internal}/admin/instances", headers={"authorization": f"Bearer {token}"}
            )
            with urllib.request.urlopen(req) as reply:
                ready = [i for i in json.load(reply)["data"] if i["state"] == "ready"]
            if len(ready) >= count:
                return
            time.sleep(0.05)
        raise RuntimeError("engines did not register")

    def stop(self):
        for proc in self.procs:
            proc.kill()
            proc.wait()
