"""Which EGL device MuJoCo renders on: the GPU the device map gave this rank (devices.py).

MuJoCo takes an index into EGL's device list (`MUJOCO_EGL_DEVICE_ID`), and that list is not
CUDA's: its order can differ from CUDA's (and nvidia-smi's), and a device that
CUDA_VISIBLE_DEVICES hides is listed without a CUDA ordinal (seen on an H100 node). So the
system GPU id is no index into it. The index is found by asking EGL for each device's CUDA
ordinal (`EGL_CUDA_DEVICE_NV`, in this process's CUDA numbering) and taking the one that is
the rank's CUDA device. The rank chooses when the device map binds it to its GPU
(devices.bind_rank_device), before MuJoCo is imported; its isolated env workers inherit the
choice: EGL lists every device whatever CUDA_VISIBLE_DEVICES hides, so an EGL index means the
same GPU in every process of a node. No torch here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

EGL_CUDA_DEVICE_NV = 0x323A


def egl_device(ordinals: list[int | None], cuda: int) -> int:
    """EGL's index of the device whose CUDA ordinal is `cuda` (`ordinals`: each EGL device's
    CUDA ordinal, None where EGL gives none)."""
    if cuda in ordinals:
        return ordinals.index(cuda)
    raise RuntimeError(
        f"EGL lists {len(ordinals)} device(s) with CUDA ordinals {ordinals}, none of them CUDA "
        f"device {cuda}: MuJoCo cannot render on the rank's GPU. Check the NVIDIA EGL "
        "libraries (libEGL_nvidia) on the node (in a container: the driver's graphics "
        "capability, NVIDIA_DRIVER_CAPABILITIES=all; Apptainer --nv), or render on the CPU "
        "with MUJOCO_GL=osmesa")


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


def choose_egl_device(cuda: int, environ=os.environ) -> None:
    """Point MuJoCo's EGL at CUDA device `cuda` of this process (the rank's GPU, as the device
    map bound it), unless the user chose a device or EGL does not render; before MuJoCo's
    import."""
    if environ.get("MUJOCO_GL", "egl") != "egl" or "MUJOCO_EGL_DEVICE_ID" in environ:
        return
    environ["MUJOCO_EGL_DEVICE_ID"] = str(egl_device(egl_cuda_ordinals(), cuda))
