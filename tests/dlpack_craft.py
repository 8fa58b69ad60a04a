"""Hand-made DLPack capsules (ctypes), to test what torch and numpy never produce here: CUDA or ROCm
device claims on a machine without them, and the read-only flag of DLPack 1.x."""

import ctypes

import numpy as np


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32), ("dtype", DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_KEEP = []  # the structs and buffers must outlive the capsules (no deleter is set)

CODES = {np.dtype(np.float32): (2, 32), np.dtype(np.float16): (2, 16), np.dtype(np.uint8): (1, 8),
         np.dtype(np.int32): (0, 32)}


def capsule(array: np.ndarray, device_type: int = 1, device_id: int = 0, versioned: bool = False,
            read_only: bool = False, major: int = 1):
    code, bits = CODES[array.dtype]
    shape = (ctypes.c_int64 * array.ndim)(*array.shape)
    strides = (ctypes.c_int64 * array.ndim)(*[s // array.itemsize for s in array.strides])
    t = DLTensor(array.ctypes.data, DLDevice(device_type, device_id), array.ndim, DLDataType(code, bits, 1),
                 shape, strides, 0)
    if versioned:
        m = DLManagedTensorVersioned(DLPackVersion(major, 0), None, None, 1 if read_only else 0, t)
        name = b"dltensor_versioned"
    else:
        m = DLManagedTensor(t, None, None)
        name = b"dltensor"
    _KEEP.extend([array, shape, strides, m, name])
    return _capsule_new(ctypes.addressof(m), name, None)
