"""Which EGL device MuJoCo renders on: the GPU the device map gave this rank (devices.py).

MuJoCo takes an index into EGL's device list (`MUJOCO_EGL_DEVICE_ID`), and that list is not
CUDA's: its order can differ from CUDA's (and nvidia-smi's), and a device that
CUDA_VISIBLE_DEVICES hides is listed without a CUDA ordinal (seen on an H100 node). So the
system GPU id is no index into it. The index is found by asking EGL for each device's CUDA
ordinal (`EGL_CUDA_DEVICE_NV`) and taking the one that is this process's CUDA device for the
rank's GPU (the rank sees the node's GPUs as CUDA_VISIBLE_DEVICES lists them). The rank
chooses when it is bound to its GPU (devices.bind_rank_device), before MuJoCo is imported;
its isolated env workers inherit the choice: EGL lists every device whatever
CUDA_VISIBLE_DEVICES hides, so an EGL index means the same GPU in every process of a node.
No torch here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

EGL_CUDA_DEVICE_NV = 0x323A


def cuda_index(system_gpu: str, environ=os.environ) -> int:
    """This process's CUDA ordinal of the GPU the system calls `system_gpu` (an index or a
    UUID, as CUDA_VISIBLE_DEVICES lists it)."""
    listed = [x.strip() for x in environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
              if x.strip()]
    if system_gpu in listed:
        return listed.index(system_gpu)
    if listed or not system_gpu.isdigit():
        raise RuntimeError(f"GPU {system_gpu} is not among CUDA_VISIBLE_DEVICES={listed}")
    return int(system_gpu)


def egl_device(ordinals: list[int | None], cuda: int) -> int:
    """EGL's index of the device whose CUDA ordinal is `cuda` (`ordinals`: each EGL device's
    CUDA ordinal, None where EGL gives none)."""
    if cuda in ordinals:
        return ordinals.index(cuda)
    raise RuntimeError(
        f"EGL lists {len(ordinals)} device(s) with CUDA ordinals {ordinals}, none of them CUDA "
        f"device {cuda}: MuJoCo cannot render on the rank's GPU. Check the NVIDIA EGL "
        "libraries (libEGL_nvidia) on the node, or render on the CPU with MUJOCO_GL=osmesa")


def egl_cuda_ordinals() -> list[int | None]:
    """Each EGL device's CUDA ordinal (None where EGL gives none), from libEGL's device
    enumeration (EGL_EXT_device_enumeration); empty without libEGL or that extension."""
    name = ctypes.util.find_library("EGL")
    if name is None:
        return []
    egl = ctypes.CDLL(name)
    egl.eglGetProcAddress.restype = ctypes.c_void_p
    egl.eglGetProcAddress.argtypes = [ctypes.c_char_p]
    query, attrib = (egl.eglGetProcAddress(n) for n in (b"eglQueryDevicesEXT",
                                                         b"eglQueryDeviceAttribEXT"))
    if not query or not attrib:
        return []
    query = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p),
                             ctypes.POINTER(ctypes.c_int))(query)
    attrib = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_int,
                              ctypes.POINTER(ctypes.c_long))(attrib)
    devices, count = (ctypes.c_void_p * 32)(), ctypes.c_int(0)
    if not query(32, devices, ctypes.byref(count)):
        return []
    ordinals = []
    for device in devices[:count.value]:
        value = ctypes.c_long(-1)
        ordinals.append(value.value if attrib(device, EGL_CUDA_DEVICE_NV, ctypes.byref(value))
                        else None)
    return ordinals


def choose_egl_device(environ=os.environ) -> None:
    """Point MuJoCo's EGL at the rank's GPU (HPCVLA_GPU, set by the device map), unless the
    user chose a device, EGL does not render, or no GPU was given; before MuJoCo's import."""
    if environ.get("MUJOCO_GL", "egl") != "egl" or "MUJOCO_EGL_DEVICE_ID" in environ \
            or not environ.get("HPCVLA_GPU"):
        return
    environ["MUJOCO_EGL_DEVICE_ID"] = str(egl_device(egl_cuda_ordinals(),
                                                     cuda_index(environ["HPCVLA_GPU"], environ)))
