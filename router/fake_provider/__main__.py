"""`python -m router.fake_provider ...`: the same as `waybill fake-provider ...`
(`router.cli.fake_provider`), for a process that has the package but not the console script.

The first line on stdout is `listening http://HOST:PORT` (with the bound port when
`--port 0`), so a parent process can read where to connect. SIGINT / SIGTERM stop it.
"""

from __future__ import annotations

from router.cli.fake_provider import fake_provider_app

if __name__ == "__main__":
    fake_provider_app(prog_name="python -m router.fake_provider")
