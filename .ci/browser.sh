#!/usr/bin/env bash
# A Chromium for the chat page's browser tests (tests/server/api/test_chat_page.py), which drive
# it through Playwright (installed with the [test] extra). Usage: .ci/browser.sh [PYTHON]
#
# Playwright's own build first (its download host may be unreachable), else Debian's `chromium`
# package (as root, with apt). Never fails: without a browser the tests skip, saying why.
python=${1:-.venv/bin/python}
if command -v chromium >/dev/null || command -v chromium-browser >/dev/null || command -v google-chrome >/dev/null; then
    exit 0
fi
if "$python" -m playwright install chromium >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; } \
        >/dev/null 2>&1 && exit 0
fi
echo ".ci/browser.sh: no Chromium could be installed; the chat page's browser tests will be skipped" >&2
exit 0
