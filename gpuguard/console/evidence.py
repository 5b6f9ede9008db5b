"""How the console and `gpuguard mcp` judge a launcher's death: on what a daemon on this
host recorded, never on the absence of a listener of their own.

They listen to no process events. Without this, every gone launcher would read
`session-ended` (nothing could listen), which a daemon that heard the launcher exit by
itself calls `launcher-exited`; so a person or an agent would act on less evidence than
the daemons. Here an exit they have no record of reads `launcher-unrecorded`, unless a
daemon's launcher memory (the remediator's `remediate.state_dir`/launchers.json, the
exporter's `--state-dir` of the shipped unit; read, never written) recorded how that
root's launcher went.
"""

from __future__ import annotations

import os

from gpuguard.config import Config
from gpuguard.host.launcher_memory import LAUNCHER_MEMORY_FILE, LauncherMemory
from gpuguard.host.procfs import UnheardExits, boot_id, identity_alive

#: Where the shipped exporter unit keeps its launcher memory (`--state-dir`,
#: deploy/systemd/gpuguard-exporter.service's StateDirectory=); GPUGUARD_EXPORTER_STATE_DIR
#: names another (an exporter started with a `--state-dir` of its own).
EXPORTER_STATE_DIR = "/var/lib/gpuguard-exporter"
EXPORTER_STATE_DIR_ENV = "GPUGUARD_EXPORTER_STATE_DIR"


def launcher_evidence(config: Config) -> tuple[UnheardExits, LauncherMemory]:
    """The exit source and launcher memory a console view classifies with: the
    remediator's memory (the daemon that kills), then the exporter's."""
    paths = [os.path.join(config.remediate.state_dir, LAUNCHER_MEMORY_FILE),
             os.path.join(os.environ.get(EXPORTER_STATE_DIR_ENV) or EXPORTER_STATE_DIR,
                          LAUNCHER_MEMORY_FILE)]
    memory = LauncherMemory.recorded(paths, boot=boot_id(), alive=identity_alive)
    return UnheardExits(), memory
