#!/bin/bash
# Turns a `make install DESTDIR=ROOT PREFIX=/usr` tree into the scheduled .deb (run by
# `make deb`): prunes what dpkg should not own, adds the Debian files (compressed man
# pages, copyright, changelog, lintian overrides, DEBIAN/ with the maintainer scripts,
# conffiles, md5sums and a control file whose Depends come from dpkg-shlibdeps) and builds
# OUT with dpkg-deb. Usage: build.sh ROOT VERSION ARCH MAINTAINER OUT
set -euo pipefail

root=$(realpath "$1") version=$2 arch=$3 maintainer=$4 out=$(realpath -m "$5")
here=$(cd "$(dirname "$0")" && pwd)
venv="$root/opt/scheduled"
[ -x "$venv/bin/python" ] || { echo "build.sh: no venv in $venv" >&2; exit 1; }
umask 022

# make install's marker (its uninstall's licence to delete the venv: dpkg owns it here),
# and pip: packages pip-installed into a dpkg-owned tree would be unknown to dpkg and
# overwritten by the next upgrade
rm -f "$venv/.scheduled-install"
rm -rf "$venv"/lib/python3*/site-packages/pip "$venv"/lib/python3*/site-packages/pip-*.dist-info \
    "$venv"/bin/pip "$venv"/bin/pip3*

# created by postinst instead (owned by the scheduled user, who does not exist at unpack)
rmdir "$root/var/lib/scheduled" "$root/var/lib" "$root/var"

# shared objects as dh_strip leaves them: no debugging symbols, not executable
find "$venv" -type f -name '*.so*' -print0 \
    | xargs -0 strip --remove-section=.comment --remove-section=.note --strip-unneeded
find "$venv" -type f -name '*.so*' -exec chmod 0644 {} +

# Debian's man pages are compressed
find "$root/usr/share/man" -type f -name '*.[0-9]' -exec gzip -9nf {} +

doc="$root/usr/share/doc/scheduled"
install -D -m 0644 "$here/copyright" "$doc/copyright"
# the date of the commit it was built from, so two builds of one commit are alike
date=$(git -C "$here" log -1 --format=%cD 2>/dev/null || date -R)
printf '%s\n' "scheduled ($version) unstable; urgency=medium" "" \
    "  * schedctl and scheduled-d $version, packaged from the source tree; the" \
    "    changes are described in README.md." "" \
    " -- $maintainer  $date" > "$doc/changelog"
gzip -9nf "$doc/changelog"
install -D -m 0644 "$here/lintian-overrides" "$root/usr/share/lintian/overrides/scheduled"

# the shared libraries' dependencies (wheels bundle most; libc, libgcc and zlib are the
# system's); a private libs directory (psycopg_binary.libs) is searched for the bundled ones
shlib=$(mktemp -d)
trap 'rm -rf "$shlib"' EXIT
mkdir "$shlib/debian"
printf 'Source: scheduled\n\nPackage: scheduled\nArchitecture: any\n' >"$shlib/debian/control"
mapfile -t objects < <(find "$root" -type f -name '*.so*' | sort)
libdirs=()
while IFS= read -r dir; do libdirs+=("-l$dir"); done < <(find "$root" -type d -name '*.libs')
shlibs=$(cd "$shlib" && dpkg-shlibdeps -O --ignore-missing-info "${libdirs[@]}" \
    "${objects[@]}" 2>/dev/null | sed -n 's/^shlibs:Depends=//p')
[ -n "$shlibs" ] || { echo "build.sh: dpkg-shlibdeps found no dependencies" >&2; exit 1; }
# the venv's interpreter is /usr/bin/python3 and its site-packages (binary wheels included)
# are for that minor version: another minor version cannot run it
pyver=$("$venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
next="${pyver%.*}.$((${pyver#*.} + 1))"
depends="python3 (>= $pyver), python3 (<< $next), adduser, $shlibs"

install -d -m 0755 "$root/DEBIAN"
install -m 0755 "$here/postinst" "$here/prerm" "$here/postrm" "$root/DEBIAN/"
install -m 0644 "$here/conffiles" "$root/DEBIAN/conffiles"
size=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
sed -e "s|@VERSION@|$version|" -e "s|@ARCH@|$arch|" -e "s|@MAINTAINER@|$maintainer|" \
    -e "s|@INSTALLED_SIZE@|$size|" -e "s|@DEPENDS@|$depends|" \
    "$here/control.in" >"$root/DEBIAN/control"
(cd "$root" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | sort -z \
    | xargs -0 md5sum) >"$root/DEBIAN/md5sums"
chmod 0644 "$root/DEBIAN/md5sums"

mkdir -p "$(dirname "$out")"
# built next to the target and renamed: a reader never sees half a package
dpkg-deb --root-owner-group -Zxz "-z${DEB_XZ_LEVEL:-1}" --build "$root" "$out.tmp" >/dev/null
mv -f "$out.tmp" "$out"
