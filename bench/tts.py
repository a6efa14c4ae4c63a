"""The TTS server (mw_servers.tts, espeak-ng) attached remotely vs no middleware. Part of
``make bench``; run alone:

    python -m bench.tts [--rounds 15]

Each reply is one text block of 34 words streamed by the offline model. Measured per reply: time
to the first text delta (what attaching the server costs the user's first words), time to the
reply's end, and with the server attached, the time from the text block's end to its first audio
delta (standard mode) or from the first text to the first audio (realtime mode). See
bench/builtins.py.
"""

from .builtins import main

if __name__ == "__main__":
    main("tts", __doc__)
