"""Address checks shared by the flag validation (arguments.py) and the launch scripts' Python side
(launch.py); standard library only, so that neither has to import the other."""

from __future__ import annotations

import ipaddress


def is_ip_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
