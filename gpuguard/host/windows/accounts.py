"""The account a Windows process runs as, by its token's user SID (`S-1-5-18`, ...).

A name is no identity: psutil's `username()` is the account's display name, which
Windows localises (`NT-AUTORITÄT\\SYSTEM`, `AUTORITE NT\\Système`) and which virtual
service accounts spell in ways no list keeps up with (`NT SERVICE\\...`,
`Window Manager\\DWM-1`, `Font Driver Host\\UMFD-0`, `IIS APPPOOL\\...`). The SID is
the same in every language; gpuguard/engine/windows/inspection.py judges it
(root_owned_sid). This is the thin edge that reads it: OpenProcess, OpenProcessToken,
GetTokenInformation(TokenUser) and ConvertSidToStringSidW over ctypes, touched only when
called (importable on Linux, where it reads nothing and says None).
"""

from __future__ import annotations

import ctypes
import functools
import sys
from typing import Any

from gpuguard.host.windows.handles import PROCESS_QUERY_LIMITED_INFORMATION, open_process
from gpuguard.host.windows.winapi import dll

TOKEN_QUERY = 0x0008
#: GetTokenInformation's class for TOKEN_USER.
TOKEN_USER_CLASS = 1
#: A TOKEN_USER larger than this is not one (a SID is at most 68 bytes).
MAX_TOKEN_USER = 4096


class SID_AND_ATTRIBUTES(ctypes.Structure):  # noqa: N801 (the Windows name)
    _fields_ = [("Sid", ctypes.c_void_p), ("Attributes", ctypes.c_uint32)]


@functools.cache
def _advapi32() -> Any:
    adv = dll("advapi32")
    handle, dword, boolean = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int
    adv.OpenProcessToken.restype = boolean
    adv.OpenProcessToken.argtypes = [handle, dword, ctypes.POINTER(handle)]
    adv.GetTokenInformation.restype = boolean
    adv.GetTokenInformation.argtypes = [handle, ctypes.c_int, ctypes.c_void_p, dword,
                                        ctypes.POINTER(dword)]
    adv.ConvertSidToStringSidW.restype = boolean
    adv.ConvertSidToStringSidW.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
    return adv


@functools.cache
def _kernel32() -> Any:
    k32 = dll("kernel32")
    k32.CloseHandle.restype = ctypes.c_int
    k32.CloseHandle.argtypes = [ctypes.c_void_p]
    k32.LocalFree.restype = ctypes.c_void_p
    k32.LocalFree.argtypes = [ctypes.c_void_p]
    return k32


def token_user_sid(process: int) -> str | None:
    """The user SID of the token of the process whose open handle is `process` (it
    needs PROCESS_QUERY_LIMITED_INFORMATION), as a string; None when any step fails."""
    adv, k32 = _advapi32(), _kernel32()
    token = ctypes.c_void_p()
    if not adv.OpenProcessToken(process, TOKEN_QUERY, ctypes.byref(token)) or not token:
        return None
    try:
        needed = ctypes.c_uint32(0)
        adv.GetTokenInformation(token, TOKEN_USER_CLASS, None, 0, ctypes.byref(needed))
        if not 0 < needed.value <= MAX_TOKEN_USER:
            return None
        buffer = ctypes.create_string_buffer(needed.value)
        if not adv.GetTokenInformation(token, TOKEN_USER_CLASS, buffer, needed.value,
                                       ctypes.byref(needed)):
            return None
        user = SID_AND_ATTRIBUTES.from_buffer(buffer)
        text = ctypes.c_void_p()
        if not user.Sid or not adv.ConvertSidToStringSidW(user.Sid, ctypes.byref(text)):
            return None
        try:
            return ctypes.wstring_at(text.value) if text.value else None
        finally:
            k32.LocalFree(text)
    finally:
        k32.CloseHandle(token)


def process_sid(pid: int) -> str | None:
    """The user SID of process `pid`; None when it cannot be read (not Windows, gone,
    access denied, no token): the caller treats None as an unknown owner (fail closed)."""
    if sys.platform != "win32":
        return None
    try:
        handle = open_process(pid, PROCESS_QUERY_LIMITED_INFORMATION)
        if handle is None:
            return None
        with handle:
            return token_user_sid(handle.raw) if handle.raw else None
    except OSError:
        return None
