"""What crosses between a Trainer and its process (bragg_train._worker): numpy arrays as
(ARRAY, dtype, shape, bytes) and numpy scalars as Python numbers, since the two sides may run
different NumPy versions (a NumPy 2 pickle names modules NumPy 1 lacks)."""

ARRAY = "__bragg_train_array__"


def pack(obj):
    """obj with every numpy array and scalar in a version-neutral form (for Connection.send)."""
    if isinstance(obj, dict):
        return {k: pack(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(pack(v) for v in obj)
    mod = type(obj).__module__
    if mod == "numpy" or mod.startswith("numpy."):
        import numpy as np
        if isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:
                return obj.tolist()
            a = np.ascontiguousarray(obj)
            return (ARRAY, a.dtype.str, a.shape, a.tobytes())
        if isinstance(obj, np.generic):
            return obj.item()
    return obj


def unpack(obj):
    """The inverse of pack: arrays come back as writable numpy arrays."""
    if isinstance(obj, tuple) and len(obj) == 4 and obj[0] == ARRAY:
        import numpy as np
        return np.frombuffer(bytearray(obj[3]), dtype=np.dtype(obj[1])).reshape(obj[2])
    if isinstance(obj, dict):
        return {k: unpack(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(unpack(v) for v in obj)
    return obj
