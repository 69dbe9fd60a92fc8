"""Working folders no other user can change while lconv works in them.

lconv checks a run's files, then reads and writes them by path: orbax, tfds and the study's writers all open by
path. Another user who can write into such a folder could swap a checked folder for a link between the check and
the use (a workdir's ``checkpoints/``, a study's folders). Rather than guard every open, lconv refuses to work in
a folder another user can change, as ``ssh`` refuses a key in a folder others can write; the one-line refusal
names the folder and the fix. ``LCONV_ALLOW_SHARED_FOLDERS=1`` accepts the risk. Details: docs/security.md.
"""
from __future__ import annotations

import os
import stat
import struct
from collections.abc import Iterator

from lconv.errors import UserError

OPT_IN = "LCONV_ALLOW_SHARED_FOLDERS"
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
_MAX_LINKS = 40  # as the kernel's own limit on links followed in one path
_WAY_FIX = "work in a folder only you can write"
_SWAP = ", so another user could swap what lconv checked there while it works"


def enforced(folder: str) -> bool:
    """Whether ``folder`` is checked: a local path on a system with owners and mode bits, and no opt-in set."""
    return "://" not in str(folder) and hasattr(os, "getuid") and os.environ.get(OPT_IN, "") != "1"


def check(folder: str, label: str, *, made_here: bool = False) -> None:
    """A one-line ``UserError`` (``label``: the flag or call that named it) when another user could change the
    working folder ``folder`` while lconv works in it (``problem``). Passing, it keeps what this process makes
    private (``keep_private``)."""
    raise_problem(problem(folder, made_here=made_here), label)


def check_way(folder: str, label: str) -> None:
    """As ``check`` for a folder lconv writes one file into (``--output_file``'s, a report's): the way to it and the
    folder itself as a folder on the way (a sticky /tmp passes), not everything else it holds."""
    raise_problem(problem(folder, whole_tree=False), label)


def check_source_folder(folder: str, label: str) -> None:
    """As ``check`` for a folder lconv reads source files from by name (a raw_dir): the way to it, the folder itself,
    which no other user may add a name to (not even as a sticky /tmp lets them: a planted file would be picked), and
    what its top level holds. Its subfolders are never read, so whoever owns them (apt's ``partial/`` in its lists
    folder) changes nothing lconv reads."""
    found = problem(folder, whole_tree=False)
    if not found and enforced(folder):
        top = os.path.abspath(os.path.expanduser(str(folder)))
        for path in [top, *_files_in(top)]:
            what = _unsafe_inside(path) or (_unsafe_target(path) if os.path.islink(path) else None)
            if what:
                found = f"{path} {what}{_SWAP}", "copy the files lconv reads from it into a folder of your own"
                break
    raise_problem(found, label)


def _unsafe_target(link: str) -> str | None:
    """What another user could change on the way a link leads, links after it followed too: a folder a name is
    looked up in, a link, or the file itself (a link into a subfolder another user owns reads their file)."""
    found = problem(link, whole_tree=False)
    return f"leads where another user could change it ({found[0]})" if found else None


def check_closed_folder(folder: str, label: str, why: str) -> None:
    """As ``check_way`` for a folder that must also take no new name from another user, not even as a sticky /tmp
    does (``why``: what a planted name would do)."""
    check_way(folder, label)
    if enforced(folder) and _others_may_make(folder):
        raise UserError(f"{label}: {folder} lets other users add files, and {why}; {_WAY_FIX} (or set {OPT_IN}=1 to "
                        "accept that risk)")


def check_code_folder(folder: str, label: str) -> None:
    """As ``check_closed_folder`` for the folder of a Python file lconv runs (a config): Python loads a
    ``__pycache__`` planted beside a module instead of it. A ``__pycache__`` already there is checked whole."""
    check_closed_folder(folder, label, "Python would run one planted there (a __pycache__) in its place")
    if not enforced(folder):
        return
    cache = os.path.join(folder, "__pycache__")
    if os.path.lexists(cache):
        check(cache, label)


def problem(folder: str, *, whole_tree: bool = True, made_here: bool = False) -> tuple[str, str] | None:
    """``(what, fix)`` when another user could change ``folder``: a folder on the way that others can write (a
    sticky one such as /tmp excepted) or that another user owns, a link on the way that another user owns, or (with
    ``whole_tree``) anything inside it that another user owns or can write, or a default ACL that would let them
    write what is made there. Also a path whose ``..`` after a link leads the system elsewhere than lconv reads it
    (lconv makes paths absolute as text), and a folder not made yet where other users may make it first (in /tmp),
    unless ``made_here``: the caller makes it and checks again. None when not ``enforced`` or nothing is wrong;
    then the umask is kept private."""
    if not enforced(folder):
        return None
    given = os.path.expanduser(str(folder))
    lexical, found = _resolve(os.path.abspath(given), made_here)
    if found:
        return f"{found}{_SWAP}", _WAY_FIX
    physical, found = _resolve(os.path.join(os.getcwd(), given), made_here)  # ".." after links, as the kernel
    if found:
        return f"{found}{_SWAP}", _WAY_FIX
    if physical != lexical:
        return (f"{folder} leads to {physical}, though read as text it names {lexical} (a '..' after a link)",
                "name the folder without '..'")
    if not whole_tree:
        found = _unsafe_on_the_way(lexical) or _default_acl(lexical)
        if found:
            return f"{lexical} {found}{_SWAP}", _WAY_FIX
    else:
        for path in _tree(lexical):
            found = _unsafe_inside(path)
            if found:
                return f"{path} {found}{_SWAP}", _inside_fix(found, lexical)
    keep_private()
    return None


def make_checked(folder: str) -> tuple[str, str] | None:
    """``folder`` made (owner-only) once the way to it passes, then ``problem``'s answer for it: made by this
    process before anything is written there, no other user can make it first, and none made through their link."""
    if not enforced(folder):
        return None
    found = problem(folder, made_here=True)  # passing, the umask is private for the folders made on the way too
    if found:
        return found
    try:
        os.makedirs(os.path.expanduser(str(folder)), mode=0o700, exist_ok=True)
    except OSError as err:
        return f"{folder} cannot be made ({err.strerror})", "name a folder you can write"
    return problem(folder)


def child_environment(package_root: str | None = None, **extra: str) -> dict[str, str]:
    """``os.environ`` (with ``extra``) for a Python process lconv starts: ``package_root``, the lconv it should
    import, first on PYTHONPATH, then the caller's entries without an empty one. Python reads an empty entry as the
    working folder even under ``-P``, so a trailing ``:`` would import another user's ``lconv/`` planted there."""
    env = {**os.environ, **extra}
    entries = [package_root] if package_root else []
    entries += [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    if entries:
        env["PYTHONPATH"] = os.pathsep.join(entries)
    else:
        env.pop("PYTHONPATH", None)
    return env


def check_owner(path: str, why: str) -> None:
    """A one-line ``UserError`` when the existing ``path`` belongs to another user (``why``: what lconv will not
    do to it): replaced, its owner's file would become this process's, with the modes it had."""
    if not enforced(path):
        return
    try:
        owner = os.lstat(path).st_uid
    except OSError:
        return
    if not _trusted(owner):
        raise UserError(f"{path}: belongs to another user (uid {owner}); {why} (remove it, write elsewhere, or set "
                        f"{OPT_IN}=1)")


def keep_private() -> None:
    """Adds group and others' write to the process's umask, so what lconv and orbax make in a checked folder passes
    the next check (under a umask of 002 the step folders and eval.py's outputs would be group-writable)."""
    old = os.umask(0o022)
    os.umask(old | 0o022)


def raise_problem(found: tuple[str, str] | None, label: str) -> None:
    """``found`` (``problem``'s answer) as the one-line ``UserError`` naming ``label``; nothing when None."""
    if found:
        what, fix = found
        raise UserError(f"{label}: {what}; {fix}, or set {OPT_IN}=1 to accept that risk (docs/security.md)")


def _inside_fix(found: str, folder: str) -> str:
    if "written" in found:  # a copy, since chmod leaves writable whatever another user already holds open
        return f"copy it into a folder only you can write (cp -r {folder} ...; a chmod would not close the files " \
               "another user may hold open)"
    if "ACL" in found:
        return f"setfacl -R -k {folder}"
    # Adopting it (chown, or a copy) would trust whatever another user put there: say to check that first.
    adopt = f"chown -R 0 {folder}" if os.getuid() == 0 else f"copy {folder} into a folder of your own"
    return f"if you did not put its contents there, remove it (another user may have planted them); if you trust " \
           f"them, {adopt}"


def _resolve(path: str, made_here: bool = False) -> tuple[str, str | None]:
    """``path`` followed from the root one name at a time as the kernel would, checking each folder a name (``..``
    too) is looked up in and each link's owner: ``(real path, None)``, or ``("", what)`` for the first thing another
    user could change. A name not there yet is taken as the plain folder ``mkdir -p`` would make, so a ``..`` after
    it leads where the kernel would then go; the real folder it would be made in has its default ACL checked, and
    must let no other user make it first unless ``made_here``."""
    pending = [part for part in path.split(os.sep) if part]
    current, links = os.sep, 0
    while pending:
        name = pending.pop(0)
        if name == os.curdir:
            continue
        found = _unsafe_on_the_way(current)  # a folder still to be made has nothing to check: None
        if found:
            return "", f"{current} {found}"
        if name == os.pardir:
            current = os.path.dirname(current)
            continue
        entry = os.path.join(current, name)
        try:
            status = os.lstat(entry)
        except OSError:  # not there yet: made in ``current``, whose default ACL would then be the new entry's
            found = _default_acl(current) or (None if made_here else _others_may_make(current))
            if found:
                return "", f"{current} {found} ({name} is not made yet)"
            current = entry
            continue
        if not stat.S_ISLNK(status.st_mode):
            current = entry
            continue
        if not _trusted(status.st_uid):
            return "", f"{entry} is a link another user owns (uid {status.st_uid})"
        links += 1
        if links > _MAX_LINKS:
            return "", f"{path} goes through more than {_MAX_LINKS} links"
        try:
            target = os.readlink(entry)
        except OSError:  # replaced since the lstat
            return "", f"{entry} changed while it was read"
        current = os.sep if os.path.isabs(target) else current
        pending[:0] = [part for part in target.split(os.sep) if part]
    return current, None


def _tree(folder: str) -> Iterator[str]:
    """``folder`` and every entry below it, links named but never followed. A stack, not ``os.walk``: Python 3.11's
    walk recurses once a folder, and another user's tree a thousand folders deep would end it in a RecursionError."""
    yield folder
    pending = [folder]
    while pending:
        top = pending.pop()
        try:
            entries = list(os.scandir(top))
        except OSError:
            continue  # removed while walked, or not ours to list: nothing in it to swap
        for entry in entries:
            yield entry.path
            if entry.is_dir(follow_symlinks=False):
                pending.append(entry.path)


def _files_in(folder: str) -> list[str]:
    """The entries of ``folder`` that are not folders (links included, never followed)."""
    try:
        return [entry.path for entry in os.scandir(folder) if not entry.is_dir(follow_symlinks=False)]
    except OSError:
        return []  # not ours to list: the reader names it


def _trusted(uid: int) -> bool:
    return uid in (os.getuid(), 0)


def trusted_owner(path: str, uid: int) -> bool:
    """Whether a file at ``path`` owned by ``uid`` is one lconv may take as written by this user (theirs or root's,
    or anyone's where the checks are not ``enforced``)."""
    return _trusted(uid) or not enforced(path)


def _unsafe_on_the_way(path: str) -> str | None:
    try:
        status = os.stat(path)
    except OSError:
        return None  # not there or not ours to look into: the command's own checks name it
    if not _trusted(status.st_uid):
        return f"belongs to another user (uid {status.st_uid})"
    if status.st_mode & _OTHERS_WRITE and not status.st_mode & stat.S_ISVTX:
        return f"can be written by other users (mode {stat.S_IMODE(status.st_mode):o})"
    return None


def _unsafe_inside(path: str) -> str | None:
    try:
        status = os.lstat(path)
    except OSError:
        return None  # removed while walked: nothing left to swap
    if not _trusted(status.st_uid):
        return f"belongs to another user (uid {status.st_uid})"
    if stat.S_ISLNK(status.st_mode):
        return None  # a link's own mode means nothing; where it leads is the reader's check
    if status.st_mode & _OTHERS_WRITE:
        return f"can be written by other users (mode {stat.S_IMODE(status.st_mode):o})"
    return _default_acl(path) if stat.S_ISDIR(status.st_mode) else None


def _others_may_make(folder: str) -> str | None:
    """A sticky folder others can write (/tmp): they may make a name in it first, as their folder or a link."""
    try:
        mode = os.stat(folder).st_mode
    except OSError:
        return None  # itself still to be made, inside a folder this walk found
    return "lets other users make that name first; make it yourself beforehand" if mode & _OTHERS_WRITE else None


def _default_acl(folder: str) -> str | None:
    if _default_acl_lets_others_write(folder):
        return "has a default ACL that lets other users write what is made in it"
    return None


# POSIX ACL entries as Linux stores them in the system.posix_acl_default attribute: a 4-byte version, then
# (tag u16, permissions u16, id u32) each; the tags that can name someone other than the owner.
_ACL_MASKED = {0x02, 0x04, 0x08}  # a named user, the owning group, a named group: limited by the mask entry
_ACL_OTHER, _ACL_MASK, _ACL_WRITE = 0x20, 0x10, 0x02


def _default_acl_lets_others_write(folder: str) -> bool:
    try:
        raw = os.getxattr(folder, "system.posix_acl_default", follow_symlinks=False)
    except (OSError, AttributeError):  # none set, a file system without ACLs, or a system without xattrs
        return False
    entries = [struct.unpack_from("<HHI", raw, offset)[:2] for offset in range(4, len(raw) - 7, 8)]
    mask_writes = all(perm & _ACL_WRITE for tag, perm in entries if tag == _ACL_MASK)
    writers = {tag for tag, perm in entries if perm & _ACL_WRITE}
    return _ACL_OTHER in writers or bool(writers & _ACL_MASKED) and mask_writes
