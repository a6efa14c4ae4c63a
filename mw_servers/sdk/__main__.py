"""``python -m mw_servers.sdk module:Class``: the same command as ``python -m agentmw.sdk``."""

from agentmw.sdk.__main__ import main

if __name__ == "__main__":
    main()
