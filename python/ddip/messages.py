"""What travels in frame payloads: cloudpickle, pickle protocol 5.

Functions, lambdas and classes defined in the notebook's __main__ are pickled by value
(cloudpickle's rule for __main__), so they work in ranks without being importable there.
"""

from __future__ import annotations

import pickle

import cloudpickle

PROTOCOL = 5


def dumps(obj) -> bytes:
    return cloudpickle.dumps(obj, protocol=PROTOCOL)


def loads(data: bytes):
    return pickle.loads(data)


class RemoteValue:
    """Stands in for a value that could not be pickled back from a rank: its type and repr."""

    def __init__(self, type_name: str, text: str):
        self.type_name = type_name
        self.text = text

    def __repr__(self) -> str:
        return self.text

    def __eq__(self, other):
        return isinstance(other, RemoteValue) and (self.type_name, self.text) == (other.type_name, other.text)
