"""The server's web chat page (issue 50, item 3), driven in headless Chromium (Debian's
``chromium`` and ``chromium-driver``, through Selenium): it types a question, waits for the
streamed answer, and checks the text against the pipeline's own answer and the figures against
the request's usage. Skips, saying what is missing, where Chromium or Selenium is not installed.
"""

from __future__ import annotations

import re
import shutil

import pytest

from ov_kvcrush.config import GenerationSettings
from ov_kvcrush.server.app import make_app
from ov_kvcrush.server.config import ServerConfig
from ov_kvcrush.server.factory import build_backend
from ov_kvcrush.server.thread import ServerThread

pytestmark = pytest.mark.model

DRIVER = shutil.which("chromedriver")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    if DRIVER is None or CHROMIUM is None:
        pytest.skip("headless Chromium needs Debian's chromium and chromium-driver (apt-get install chromium-driver)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()


def test_the_page_streams_the_answer_and_shows_its_kv_bytes_and_timings(browser, model_dir):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    backend = build_backend(ServerConfig(model=str(model_dir), max_queue=4))
    question = "What is the capital of France?"
    want = backend.pipeline.generate([[{"role": "user", "content": question}]], GenerationSettings(max_new_tokens=256))[
        0
    ]
    with ServerThread(make_app(backend)) as server:
        browser.get(server.url + "/")
        WebDriverWait(browser, 60).until(lambda d: d.find_element(By.ID, "model").text == backend.model_name)
        browser.find_element(By.ID, "question").send_keys(question)
        browser.find_element(By.ID, "send").click()
        turn = WebDriverWait(browser, 120).until(lambda d: d.find_element(By.CSS_SELECTOR, ".turn[data-done='1']"))
        assert turn.find_element(By.CLASS_NAME, "user").text == question
        assert turn.find_element(By.CLASS_NAME, "answer").text == want.text.strip()
        figures = turn.find_element(By.CLASS_NAME, "figures")
        assert int(figures.get_attribute("data-kv-bytes")) == want.kv_bytes
        assert int(figures.get_attribute("data-full-kv-bytes")) == want.full_kv_bytes
        assert int(figures.get_attribute("data-completion-tokens")) == want.generated_tokens
        shown = figures.text
        assert re.search(r"KV \d+\.\d\d MiB held of \d+\.\d\d MiB full \(\d+ %\) · TTFT \d+ ms · TPOT", shown), shown
        assert float(figures.get_attribute("data-ttft-ms")) > 0


def test_the_page_stops_an_answer_samples_at_its_temperature_and_shows_the_pool(browser, model_dir):
    """Stop cancels the streamed answer (the server frees the request); the temperature setting
    reaches the request; each answer shows the pool after it, as ``GET /pool`` reports it."""
    import time

    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    backend = build_backend(ServerConfig(model=str(model_dir), max_queue=4))
    with ServerThread(make_app(backend)) as server:
        browser.get(server.url + "/")
        WebDriverWait(browser, 60).until(lambda d: d.find_element(By.ID, "model").text == backend.model_name)
        browser.execute_script("document.getElementById('max-tokens').value = 2000")
        browser.find_element(By.ID, "question").send_keys("Tell me a very long story about a lighthouse.")
        browser.find_element(By.ID, "send").click()
        WebDriverWait(browser, 120).until(lambda d: d.find_element(By.CSS_SELECTOR, ".turn .answer").text)
        browser.find_element(By.ID, "stop").click()
        stopped = WebDriverWait(browser, 60).until(lambda d: d.find_element(By.CSS_SELECTOR, ".turn[data-done='1']"))
        assert stopped.get_attribute("data-stopped") == "1"
        assert WebDriverWait(browser, 60).until(lambda d: d.find_element(By.ID, "send").is_enabled())
        end = time.monotonic() + 60  # the request is cancelled at the server's next step
        while backend.in_flight and time.monotonic() < end:
            time.sleep(0.05)
        assert backend.in_flight == 0 and not backend.pipeline.has_non_finished_requests()
        browser.execute_script("document.getElementById('max-tokens').value = 16;"
                               "document.getElementById('temperature').value = 1.5")  # fmt: skip
        browser.find_element(By.ID, "question").send_keys("Name a color.")
        browser.find_element(By.ID, "send").click()
        turns = WebDriverWait(browser, 120).until(
            lambda d: (
                len(d.find_elements(By.CSS_SELECTOR, ".turn[data-done='1']")) == 2
                and d.find_elements(By.CSS_SELECTOR, ".turn[data-done='1']")
            )
        )
        figures = turns[1].find_element(By.CLASS_NAME, "figures")
        pool = backend.stats()  # at idle: what the page fetched after the answer
        assert int(figures.get_attribute("data-pool-blocks-used")) == pool["blocks_used"]
        assert int(figures.get_attribute("data-pool-kept")) == pool["kept"] >= 1  # the full cache keeps it
        assert int(figures.get_attribute("data-pool-on-disk")) == pool["on_disk"]  # no --cache-dir: 0
        assert "pool: " in figures.text and "on disk: 0 (0.0 MiB)" in figures.text
        # the temperature reaches the request: one out of range comes back as the server's 400
        browser.execute_script("document.getElementById('temperature').value = 5")
        browser.find_element(By.ID, "question").send_keys("Name a color.")
        browser.find_element(By.ID, "send").click()
        refused = WebDriverWait(browser, 60).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".figures.error"))
        assert "400: temperature=5" in refused[-1].text
