# The compiled KV block hashing (protocol/_kvhash.c), built by setup.py when a C compiler is there.
from typing_extensions import Buffer

def chain_hash_bytes(parent: int, data: Buffer, block_bytes: int, first_extra: Buffer = ...,
                     /) -> bytes: ...
