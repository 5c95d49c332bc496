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
