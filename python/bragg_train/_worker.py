"""The trainer's own process: ``python -m bragg_train._worker FD``, serving one connection.

bragg_train.Trainer runs the C++ trainer here by default, so that the caller's process never
loads the trainer's libtorch (Debian's 1.13): two libtorch builds in one process resolve each
other's symbols and crash, and an RL loop's process usually holds PyPI's torch. Requests are
(op, args) tuples over a multiprocessing Connection on a socket the parent made; every answer is
("ok", value) or ("err", exception). End of input (the parent closed it or died) ends the
process.
"""

import sys
from multiprocessing.connection import Connection

from ._wire import pack, unpack

def options(d):
    """A TrainOptions from a dict of field names (the parent checked the names)."""
    from . import _core
    o = _core.TrainOptions()
    for name, value in d.items():
        try:
            setattr(o, name, value)
        except TypeError as e:
            raise TypeError(f"trainer option {name}={value!r}: {e}") from None
    return o


def defaults():
    from . import _core
    o = _core.TrainOptions()
    return {n: getattr(o, n) for n in dir(_core.TrainOptions) if not n.startswith("_")}


def serve(conn):
    from . import _core
    trainer = None
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):
            return
        args = unpack(args)
        try:
            if op == "create":
                trainer = _core.Trainer.create(options(args[0]))
                value = None
            elif op == "resume":
                trainer = _core.Trainer.resume(args[0], options(args[1]))
                value = None
            elif op == "call":
                if trainer is None:
                    raise RuntimeError("no trainer in this process")
                name, call_args = args
                value = getattr(trainer, name)(*call_args)
            elif op == "get":
                value = getattr(trainer, args[0])
                if args[0] == "options":
                    value = {n: getattr(value, n) for n in defaults()}
            elif op == "set":
                setattr(trainer, args[0], args[1])
                value = None
            elif op == "defaults":
                value = defaults()
            elif op == "read_trajectories":
                value = _core.read_trajectories(*args)
            elif op == "group_advantages":
                value = _core.group_advantages(*args)
            elif op == "close":
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"unknown request {op!r}")
        except Exception as e:  # noqa: BLE001 (every error goes back to the caller)
            try:
                conn.send(("err", e))
            except Exception:  # noqa: BLE001 (an exception that does not pickle)
                conn.send(("err", RuntimeError(f"{type(e).__name__}: {e}")))
            continue
        conn.send(("ok", pack(value)))


def main():
    conn = Connection(int(sys.argv[1]))
    try:
        serve(conn)
    finally:
        conn.close()


if __name__ == "__main__":
    main()
