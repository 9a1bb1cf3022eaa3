"""Account names for messages, status and the audit trail (light enough for the shim)."""
from __future__ import annotations


def user_name(uid: int) -> str:
    """The login name of UID, or "uid N" when the account database has none."""
    import pwd  # a C module: no cost to speak of, but only when a name is needed

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def either(*uids: int) -> str:
    """"root or alice" for UIDS, in their order, each user named once ("root", not "root or root")."""
    return " or ".join(dict.fromkeys(user_name(uid) for uid in uids))
