"""A wide real process tree, cheaply: a tiny C program that forks N children that pause().

A Python child per member would cost megabytes each (copy-on-write pages touched by
reference counts); these cost a few pages, so a 1,100-process tree stays within the
memory and spawn time of a small CI machine. Compiled once per session with gcc, as the
fake NVML is (tests/support/fakenvml).

    fanout N PIDFILE   # forks N children, each pause()s; writes PIDFILE once all exist
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SOURCE = r"""
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc != 3) { fprintf(stderr, "usage: fanout N PIDFILE\n"); return 2; }
    int n = atoi(argv[1]);
    for (int i = 0; i < n; i++) {
        pid_t child = fork();
        if (child < 0) { perror("fork"); return 1; }
        if (child == 0) { for (;;) pause(); }
    }
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", argv[2]);
    FILE *out = fopen(tmp, "w");
    if (out == NULL) { perror("fopen"); return 1; }
    fprintf(out, "%d\n", (int)getpid());
    fclose(out);
    rename(tmp, argv[2]);  /* the pid file appears whole, once every child exists */
    for (;;) { if (wait(NULL) < 0) pause(); }  /* reap the children as they go */
    return 0;
}
"""


def build_fanout(dest_dir: Path) -> Path:
    """Compile the fan-out program into `dest_dir`; its path."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise RuntimeError("gcc not found on PATH: cannot build the fan-out helper")
    dest_dir.mkdir(parents=True, exist_ok=True)
    source = dest_dir / "fanout.c"
    source.write_text(SOURCE)
    binary = dest_dir / "fanout"
    subprocess.run([gcc, "-O2", "-Wall", "-o", str(binary), str(source)], check=True,
                   capture_output=True, timeout=120)
    return binary
