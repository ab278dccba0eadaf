"""The compiled KV block hashing (``protocol/_kvhash.c``) gives exactly the hashes of the scheme
as ``hashlib`` computes them, and an install without it works the same, saying so."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
from array import array

import pytest

from protocol import kv_hash, native


def reference(parent: int, data: bytes, block_bytes: int, extra: bytes) -> list[int]:
    """The scheme, written from its definition: BLAKE2b-64 of parent, extra length, extra
    (first block only), block."""
    out = []
    for i in range(len(data) // block_bytes):
        e = extra if i == 0 else b""
        msg = parent.to_bytes(8, "little") + len(e).to_bytes(2, "little") + e \
            + data[i * block_bytes:(i + 1) * block_bytes]
        parent = int.from_bytes(hashlib.blake2b(msg, digest_size=8).digest(), "little")
        out.append(parent)
    return out


def test_the_install_built_the_compiled_hashing() -> None:
    # this machine has a C compiler: `pip install .` must have built it
    assert kv_hash.NATIVE, native.missing()
    assert native.warning() is None


@pytest.mark.parametrize("seed", range(4))
def test_compiled_hashes_are_the_schemes_for_every_length(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(400):
        bb = rng.choice([4, 8, 60, 64, 124, 128, 132, 1024])
        data = os.urandom(bb * rng.randint(0, 12) + rng.randint(0, bb - 1))  # a partial tail too
        extra = os.urandom(rng.choice([0, 1, 5, 116, 117, 118, 119, 250]))
        parent = rng.getrandbits(64)
        want = reference(parent, data, bb, extra)
        assert kv_hash.chain_hashes(parent, data, bb, extra) == want
        assert kv_hash.chain_hash_array(parent, data, bb, extra) == array("Q", want)


def test_a_long_run_hashed_without_the_gil_is_the_same() -> None:
    data = os.urandom(64 * 5000)  # over the length at which the GIL is given up
    assert kv_hash.chain_hashes(7, data, 64, b"salt") == reference(7, data, 64, b"salt")


def test_bad_arguments_are_errors_not_crashes() -> None:
    with pytest.raises(ValueError):
        kv_hash.chain_hashes(1, b"x" * 64, 0)
    with pytest.raises(ValueError):
        kv_hash.chain_hashes(1, b"x" * 64, 64, b"e" * 70_000)
    with pytest.raises(OverflowError):
        kv_hash.chain_hashes(-1, b"x" * 64, 64)


def test_without_the_compiled_module_the_same_hashes_and_a_warning() -> None:
    code = (
        "import sys; sys.modules['protocol._kvhash'] = None\n"
        "from protocol import kv_hash, native\n"
        "assert not kv_hash.NATIVE\n"
        "print(kv_hash.chain_hashes(7, bytes(range(256)) * 3, 64, b'salt'))\n"
        "print(native.warning())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[0] == str(reference(7, bytes(range(256)) * 3, 64, b"salt"))
    assert "protocol._kvhash" in out[1] and "slower" in out[1]
