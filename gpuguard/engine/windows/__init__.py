"""The engine on Windows: the reap (reaper.py, over control.py's handles), the live
inspection of a tree from a process table (inspection.py) and `gpuguard run`'s Job
Object launcher (launcher.py). Only the programs and gpuguard/engine/platforms.py import
it: it builds on engine/reap/ and engine/decision/, which never import it back."""
