"""The demo page at ``GET /`` driven in a real headless browser (Debian's chromium through
chromedriver and selenium) against a live ``mmspec serve`` on a loopback port with the embedded
default models: an uploaded or dropped image -> a caption streaming in with its speedup and plain
decoding's stats beside it; a prompt -> an image; a text -> an audio player that plays.

Skipped, with the reason, where chromium, chromedriver or selenium is missing (scripts/install.sh
installs the browser with apt when it runs as root; selenium comes with the ``test`` extra).
"""

from __future__ import annotations

import base64
import re
import shutil
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install 'mmspec[test]')")

from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from mmspec.serve import ServeConfig, create_app  # noqa: E402
from mmspec.serve.background import serve_in_thread  # noqa: E402

SAMPLES = Path(__file__).resolve().parents[1] / "samples"
KEY = "page-key"
BROWSER = next((shutil.which(name) for name in ("chromium", "chromium-browser") if shutil.which(name)), None)
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    BROWSER is None or DRIVER is None,
    reason="no headless browser: the page test needs Debian's chromium and chromedriver "
           "(apt-get install chromium chromium-driver; scripts/install.sh does it when run as root)")
#: how long one panel may take at most (pipeline load + method + plain decoding on a busy 2-core CPU)
PANEL_TIMEOUT_S = 120
#: "<method>: tau T | ... | W s | batch B", then plain decoding's line, then the speedup; the method
#: is a name or a spec with its argument ("eagle:PATH" where drafter="auto" picked a head by path)
STATS = re.compile(r"^\w[\w-]*(:[^\n]*?)?: tau \d+\.\d\d .*\| \d+\.\d\d s \| batch \d+\n"
                   r"plain decoding: tau 1\.00 \| \d+\.\d\d s\nspeedup \d+\.\d\dx", re.M)


@pytest.fixture(scope="module")
def page():
    """The page of a live server (fp32, speech capped at 1 s), open in headless chromium."""
    app = create_app(ServeConfig(dtype="float32", api_key=KEY, max_speech_seconds=1.0))
    options = webdriver.ChromeOptions()
    options.binary_location = BROWSER
    # root in a container: no sandbox; a small /dev/shm: use /tmp; play audio without a user gesture
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--autoplay-policy=no-user-gesture-required",
                 "--mute-audio"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    with serve_in_thread(app) as base:
        driver = webdriver.Chrome(options=options, service=Service(DRIVER))
        try:
            driver.get(base + "/")
            driver.find_element(By.ID, "key").send_keys(KEY)  # every test starts with the key typed (any order, any worker)
            yield driver
        finally:
            driver.quit()


def text_of(driver, element_id: str) -> str:
    return driver.find_element(By.ID, element_id).text


def wait_for(driver, predicate, timeout: float = PANEL_TIMEOUT_S):
    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: predicate(d))


def test_page_loads_without_script_errors(page):
    assert page.title == "mmspec serve"
    errors = [entry["message"] for entry in page.get_log("browser") if entry["level"] == "SEVERE"]
    assert not errors, errors  # a syntax error in the page's script would leave every button dead


def test_a_missing_api_key_is_shown_as_the_error(page):
    """Without the key: the server's 401 message in the panel, in red, and no image (the key is
    typed again after, for the other tests)."""
    page.find_element(By.ID, "key").clear()
    try:
        page.find_element(By.ID, "imggo").click()
        error = wait_for(page, lambda d: d.find_elements(By.CSS_SELECTOR, "#imgstats .error"), 10)[0]
        assert "API key" in error.text
        assert not page.find_element(By.ID, "imgout").is_displayed()
    finally:
        page.find_element(By.ID, "key").send_keys(KEY)


def test_uploaded_or_dropped_image_captions_streaming_with_stats(page):
    # chosen with the file input: the preview shows it and the button comes on
    page.find_element(By.ID, "file").send_keys(str(SAMPLES / "scenes.png"))
    wait_for(page, lambda d: d.find_element(By.ID, "capgo").is_enabled(), 10)
    first = page.find_element(By.ID, "capimg").get_attribute("src")
    assert first.startswith("data:image/png;base64,")
    # dropped on the drop zone (a synthetic drop carrying a File): the preview changes to it
    photo = base64.b64encode((SAMPLES / "photo.png").read_bytes()).decode()
    page.execute_script("""
        const bytes = Uint8Array.from(atob(arguments[0]), (c) => c.charCodeAt(0));
        const transfer = new DataTransfer();
        transfer.items.add(new File([bytes], "photo.png", {type: "image/png"}));
        document.getElementById("drop").dispatchEvent(new DragEvent("drop", {dataTransfer: transfer, bubbles: true}));
    """, photo)
    wait_for(page, lambda d: d.find_element(By.ID, "capimg").get_attribute("src") == "data:image/png;base64," + photo, 10)
    # every text the caption box shows, recorded as it changes (each `textContent +=` puts in a new
    # text node: the records keep them all, even when several pieces arrive in one network read)
    page.execute_script("""
        window.captionSeen = [];
        new MutationObserver((records) => {
            for (const record of records) for (const node of record.addedNodes) window.captionSeen.push(node.textContent);
        }).observe(document.getElementById("captext"), {childList: true});
    """)
    max_tokens = page.find_element(By.ID, "maxtokens")
    max_tokens.clear()
    max_tokens.send_keys("6")
    page.find_element(By.ID, "capgo").click()
    wait_for(page, lambda d: "speedup" in text_of(d, "capstats") or d.find_elements(By.CSS_SELECTOR, "#capstats .error"))
    stats, caption = text_of(page, "capstats"), text_of(page, "captext")
    assert STATS.search(stats), stats
    said = re.search(r"plain decoding said: (.*) \(identical: (\w+)\)", stats)
    assert said and said.group(1) == caption and said.group(2) == "true", stats  # greedy: plain decoding's words
    seen = [text for text in page.execute_script("return window.captionSeen") if text]
    assert seen[-1] == caption and len(seen) >= min(2, len(caption.split()))  # it came in pieces
    assert all(later.startswith(earlier) for earlier, later in zip(seen, seen[1:]))


def test_prompt_makes_an_image_with_stats(page):
    page.find_element(By.ID, "imggo").click()
    wait_for(page, lambda d: "speedup" in text_of(d, "imgstats") or d.find_elements(By.CSS_SELECTOR, "#imgstats .error"))
    assert STATS.search(text_of(page, "imgstats")), text_of(page, "imgstats")
    image = page.find_element(By.ID, "imgout")
    assert image.is_displayed() and page.execute_script("return arguments[0].complete && arguments[0].naturalWidth", image) > 0


def test_text_gives_an_audio_player_that_plays(page):
    page.find_element(By.ID, "ttsgo").click()
    wait_for(page, lambda d: "speedup" in text_of(d, "ttsstats") or d.find_elements(By.CSS_SELECTOR, "#ttsstats .error"))
    assert STATS.search(text_of(page, "ttsstats")), text_of(page, "ttsstats")
    audio = page.find_element(By.ID, "audio")
    assert audio.is_displayed() and audio.get_attribute("src").startswith("blob:")
    played = page.execute_async_script("""
        const [audio, done] = arguments;
        audio.addEventListener("error", () => done("error " + audio.error.code));
        audio.addEventListener("ended", () => done(audio.duration));
        audio.play().catch((e) => done(String(e)));
    """, audio)
    assert isinstance(played, float) and 0 < played <= 1.1, played  # decoded and played to the end (<= 1 s asked)
