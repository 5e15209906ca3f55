"""Fetches torch's own test files for the installed python3-torch from Debian's source package
(or, with a suite named, the newest pytorch source package of that Debian release: trixie's
torch 2.x files for the torch 2.x lane's wheel).

`apt-get source --download-only` runs under a private apt configuration whose every writable
path lies in the cache directory given (sources list, lists, caches, state), so nothing
system-wide changes and it works as root and as any other user. The deb-src line is made from
the machine's own Debian archive entry (/etc/apt/sources.list, *.list or deb822 *.sources).

Only the files named in `wanted` are extracted, from the upstream (orig) tarball; Debian's
patches (the debian tarball) are not applied. A stamp records the source version and the
tarball's SHA-256 (as the .dsc states it), so a second run reuses what is there.
"""
import glob
import hashlib
import os
import pwd
import re
import shutil
import subprocess
import tarfile

STAMP = "sources.stamp"


class SourcesUnavailable(Exception):
    """The test files cannot be had here (no matching archive entry, no network, apt failed)."""


def installed_source(binary="python3-torch"):
    """(source package, source version) of the installed binary package."""
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f", "${source:Package} ${source:Version}", binary],
                             check=True, capture_output=True, text=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        raise SourcesUnavailable(f"{binary} is not installed as a Debian package") from None
    return out[0], out[1]


def _codename():
    with open("/etc/os-release") as f:
        for line in f:
            if line.startswith("VERSION_CODENAME="):
                return line.split("=", 1)[1].strip().strip('"')
    raise SourcesUnavailable("/etc/os-release names no VERSION_CODENAME")


def _one_line_entries(text):
    # `deb [opt=value ...] URI suite component...`
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        m = re.match(r"(deb|deb-src)\s+(?:\[([^\]]*)\]\s+)?(\S+)\s+(\S+)\s*(.*)", line)
        if not m:
            continue
        opts = dict(o.split("=", 1) for o in (m.group(2) or "").split() if "=" in o)
        yield {"uri": m.group(3), "suites": [m.group(4)], "components": m.group(5).split(),
               "signed_by": opts.get("signed-by")}


def _deb822_entries(text):
    # Stanzas separated by blank lines; `Key: value`, comment lines start with '#'.
    for stanza in re.split(r"\n\s*\n", text):
        fields = {}
        for line in stanza.splitlines():
            if line.startswith("#") or ":" not in line or line[:1].isspace():
                continue
            key, value = line.split(":", 1)
            fields[key.strip().lower()] = value.strip()
        if not fields.get("uris") or fields.get("enabled", "yes").lower() == "no":
            continue
        if not {"deb", "deb-src"} & set(fields.get("types", "").split()):
            continue
        for uri in fields["uris"].split():
            yield {"uri": uri, "suites": fields.get("suites", "").split(),
                   "components": fields.get("components", "").split(),
                   "signed_by": fields.get("signed-by")}


def archive_entry():
    """The machine's Debian archive for its release: (URI, suite, signed-by or None).

    The entry whose suite is the release's codename itself (not -updates or -security) and
    that has the main component; deb.debian.org is preferred when several match.
    """
    codename = _codename()
    found = []
    for path in ["/etc/apt/sources.list"] + sorted(glob.glob("/etc/apt/sources.list.d/*")):
        try:
            text = open(path, encoding="utf-8").read()
        except OSError:
            continue
        if path.endswith(".sources"):
            entries = _deb822_entries(text)
        elif path.endswith(".list"):
            entries = _one_line_entries(text)
        else:
            continue
        found += [e for e in entries if codename in e["suites"] and "main" in e["components"]]
    if not found:
        raise SourcesUnavailable(f"no apt source for Debian {codename} main in /etc/apt/sources.list*")
    found.sort(key=lambda e: "deb.debian.org" not in e["uri"])
    return found[0]["uri"], codename, found[0]["signed_by"]


def _apt_options(apt_dir):
    d = {name: os.path.join(apt_dir, name) for name in ("etc", "parts", "lists", "cache", "state")}
    for path in d.values():
        os.makedirs(path, exist_ok=True)
    os.makedirs(os.path.join(d["lists"], "partial"), exist_ok=True)
    os.makedirs(os.path.join(d["cache"], "archives", "partial"), exist_ok=True)
    options = {
        "Dir::Etc::SourceList": os.path.join(d["etc"], "sources.list"),
        "Dir::Etc::SourceParts": d["parts"],          # empty: the system's lists are not read
        "Dir::Etc::Preferences": os.path.join(d["etc"], "preferences"),
        "Dir::Etc::PreferencesParts": d["parts"],
        "Dir::State": d["state"],
        "Dir::State::Lists": d["lists"],
        "Dir::State::status": "/var/lib/dpkg/status",  # read only
        "Dir::Cache": d["cache"],
        # apt drops to the _apt user for downloads when root, and _apt cannot write into a
        # build tree; naming the current user keeps every download as the caller.
        "APT::Sandbox::User": pwd.getpwuid(os.getuid()).pw_name,
    }
    args = []
    for key, value in options.items():
        args += ["-o", f"{key}={value}"]
    return args, options["Dir::Etc::SourceList"], d["lists"]


def _dsc_sha256(dsc_path):
    """{file name: sha256} from a .dsc's Checksums-Sha256 field."""
    sums, inside = {}, False
    for line in open(dsc_path, encoding="utf-8"):
        if line.startswith("Checksums-Sha256:"):
            inside = True
        elif inside and line.startswith(" "):
            digest, _size, name = line.split()
            sums[name] = digest
        else:
            inside = False
    return sums


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _source_list(cache_dir, suite=None):
    """apt's options for the private state under cache_dir, with a sources list holding the
    deb-src line of the machine's archive for `suite` (default: the release's own)."""
    uri, own, signed_by = archive_entry()
    suite = suite or own
    apt_args, source_list, lists = _apt_options(os.path.join(cache_dir, "apt"))
    opts = f" [signed-by={signed_by}]" if signed_by else ""
    with open(source_list, "w") as f:
        f.write(f"deb-src{opts} {uri} {suite} main\n")
    return apt_args, lists, uri, suite


def newest_source(cache_dir, package, suite, log_path):
    """The newest version of source package `package` in Debian `suite` (apt-get update of a
    private state, then apt-cache showsrc). Raises SourcesUnavailable."""
    cache_dir = os.path.abspath(cache_dir)
    os.makedirs(cache_dir, exist_ok=True)
    apt_args, lists, uri, suite = _source_list(cache_dir, suite)
    with open(log_path, "a") as log:
        error, _ = _apt(["apt-get", *apt_args, "-q", "update"], cache_dir, log)
        if error:
            raise SourcesUnavailable(error)
        _, r = _apt(["apt-cache", *apt_args, "showsrc", package], cache_dir, log)
    versions = [l.split(None, 1)[1] for l in r.stdout.splitlines() if l.startswith("Version: ")]
    if not versions:
        raise SourcesUnavailable(f"Debian {suite} has no source package {package}")
    newest = versions[0]
    for v in versions[1:]:
        if subprocess.run(["dpkg", "--compare-versions", v, "gt", newest]).returncode == 0:
            newest = v
    return newest


def _apt(cmd, cwd, log):
    """Runs an apt command, logged: (the first "Failed to fetch" or "E:" line or "", the
    result). apt-get update exits 0 when an index cannot be fetched (no network): that line is
    the reason to give."""
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    log.write(f"$ {' '.join(cmd)}\n{r.stdout}{r.stderr}\n")
    errors = [l for l in (r.stdout + r.stderr).splitlines()
              if "Failed to fetch" in l or l.startswith("E:")]
    return (errors[0] if errors else ""), r


def _download(cache_dir, package, version, log, suite=None):
    apt_args, lists, uri, suite = _source_list(cache_dir, suite)
    downloads = os.path.join(cache_dir, "downloads")
    os.makedirs(downloads, exist_ok=True)
    print(f"fetching {package} {version} sources from {uri} {suite} (private apt state in "
          f"{os.path.join(cache_dir, 'apt')})", flush=True)
    # The indexes, unless newest_source fetched them just now; an update that failed is the
    # reason to give, and the source step is not tried.
    indexed = any(n not in ("partial", "lock") for n in os.listdir(lists))
    reason = "" if indexed else _apt(["apt-get", *apt_args, "-q", "update"], cache_dir, log)[0]
    if not reason:
        # apt-get exits non-zero when any file of the source package fails; only the .dsc and
        # the orig tarball are needed (a mirror that lacks the debian tarball is enough).
        reason = _apt(["apt-get", *apt_args, "-q", "source", "--download-only",
                       f"{package}={version}"], downloads, log)[0]
    dsc, orig = _paths(cache_dir, package, version)
    if not os.path.exists(dsc) or orig is None or not os.path.exists(orig):
        raise SourcesUnavailable(f"apt-get source {package}={version} failed: {reason or 'see the log'}")


def _paths(cache_dir, package, version):
    """The .dsc's path and the orig tarball's path it names (None while the .dsc is absent)."""
    downloads = os.path.join(cache_dir, "downloads")
    dsc = os.path.join(downloads, f"{package}_{version.split(':')[-1]}.dsc")
    if not os.path.exists(dsc):
        return dsc, None
    origs = [n for n in _dsc_sha256(dsc) if ".orig.tar." in n]
    return dsc, os.path.join(downloads, origs[0]) if len(origs) == 1 else None


def _downloaded(cache_dir, package, version):
    """(orig tarball, its SHA-256) when both files are there and the digest is the .dsc's."""
    dsc, orig = _paths(cache_dir, package, version)
    if orig is None or not os.path.exists(orig):
        return None
    digest = _sha256(orig)
    return (orig, digest) if _dsc_sha256(dsc)[os.path.basename(orig)] == digest else None


def fetch(cache_dir, wanted, log_path, suite=None):
    """The directory that holds the files `wanted` (paths relative to the source tree's root,
    e.g. "test/test_dataloader.py"), fetching and extracting them unless the stamp says they
    are there for the installed version (with `suite`, e.g. "trixie": for pytorch in that
    Debian release, whose newest version is looked up once and then kept in the stamp).
    Raises SourcesUnavailable."""
    cache_dir = os.path.abspath(cache_dir)  # apt reads relative Dir:: paths below /etc/apt
    tree = os.path.join(cache_dir, "src")
    stamp_path = os.path.join(cache_dir, STAMP)
    have = open(stamp_path).read().split() if os.path.exists(stamp_path) else []
    if suite is None:
        package, version = installed_source()
        key = [package, version]
        if have[:2] != key:
            os.makedirs(cache_dir, exist_ok=True)
            open(log_path, "w").close()
    else:
        key = ["pytorch", "suite=" + suite]
        if have[:2] == key and len(have) > 2:
            version = have[2]
        else:
            os.makedirs(cache_dir, exist_ok=True)
            open(log_path, "w").close()
            version = newest_source(cache_dir, "pytorch", suite, log_path)
    try:
        if have[:len(key)] == key and all(os.path.exists(os.path.join(tree, w)) for w in wanted):
            return tree
        package = key[0]
        found = _downloaded(cache_dir, package, version)
        if found is None:
            with open(log_path, "a") as log:
                _download(cache_dir, package, version, log, suite)
            found = _downloaded(cache_dir, package, version)
            if found is None:
                raise SourcesUnavailable(
                    f"{package} {version}: the orig tarball's SHA-256 differs from the .dsc's")
        orig, digest = found
        name = os.path.basename(orig)
        shutil.rmtree(tree, ignore_errors=True)
        with tarfile.open(orig) as tar:
            # The tarball has one top directory (pytorch-1.13.1/); members are matched below it.
            members = {m.name.split("/", 1)[1]: m for m in tar.getmembers() if "/" in m.name}
            missing = [w for w in wanted if w not in members]
            if missing:
                raise SourcesUnavailable(f"{name} lacks {', '.join(missing)}")
            for w in wanted:
                target = os.path.join(tree, w)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with tar.extractfile(members[w]) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)
        with open(stamp_path, "w") as f:
            f.write(" ".join(key) + (f" {version}" if suite else "") + f" {digest}\n")
        return tree
    finally:
        # The indexes (20 MB) are needed again only to look a version up or fetch again.
        shutil.rmtree(os.path.join(cache_dir, "apt", "lists"), ignore_errors=True)
