"""The mem0 server (mw_servers.mem0) attached remotely vs no middleware: time to first text (and
reply end) of a reply of 1,000 text deltas. Part of ``make bench`` (which builds the mem0 venv);
run alone (after ``make mem0``):

    python -m bench.mem0 [--rounds 15]

The server is the offline default (bundled all-MiniLM-L6-v2, Qdrant local store in a temporary
directory), mode ``static``: before the reply it searches the user's memories (one embedding and
one vector search) and inserts a hint; after it, it writes the exchange back (awaited, so the
reply end includes two more embeddings). The store is seeded with a few memories first. See
bench/builtins.py.
"""

from .builtins import main

if __name__ == "__main__":
    main("mem0", __doc__)
