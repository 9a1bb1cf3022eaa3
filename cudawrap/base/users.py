"""Account names for messages, status and the audit trail (light enough for the shim)."""

import time

NAME_KEPT_S = 60.0  # a name looked up is believed this long (a rename shows after it)
_names: "dict[int, tuple[str, float]]" = {}  # uid -> (its name, when looked up: time.monotonic())


def user_name(uid: int) -> str:
    """The login name of UID, or "uid N" when the account database has none.

    Kept NAME_KEPT_S: the service names a grant's user in its record before the grant is
    sent, and where accounts come from LDAP or sssd a lookup can take milliseconds."""
    now = time.monotonic()
    kept = _names.get(uid)
    if kept is not None and now - kept[1] < NAME_KEPT_S:
        return kept[0]
    import pwd  # a C module: no cost to speak of, but only when a name is needed

    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"  # not kept: an account made meanwhile is named at once
    if len(_names) >= 4096:
        _names.clear()  # a long-lived service: only the users of late matter
    _names[uid] = (name, now)
    return name


def either(*uids: int) -> str:
    """"root or alice" for UIDS, in their order, each user named once ("root", not "root or root")."""
    return " or ".join(dict.fromkeys(user_name(uid) for uid in uids))
