"""The web console in a real browser: Debian's chromium, headless, driven by Selenium through
Debian's chromium-driver (/usr/bin/chromedriver, given explicitly so Selenium Manager never
downloads anything), against the API served on loopback over Postgres. Signs in, finds a
job, sees its runs and timeline, follows a running run's output until it finishes, pauses
and resumes the job, replays a dead letter, and saves a screenshot of each page into the
test's tmp_path. Every wait is bounded; the browser is quit in the fixture's finally."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import WebDriverWait

from schedctl.app.service import Scheduler
from tests.integration.api_support import serving
from tests.integration.console_support import finish_running, seed

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WAIT_SECONDS = 20

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.slow,
    pytest.mark.skipif(
        not (os.access(CHROMIUM, os.X_OK) and shutil.which(CHROMEDRIVER)),
        reason="chromium and chromium-driver are not installed (make system-deps)",
    ),
]


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new",
        "--no-sandbox",  # the tests run as root
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,1000",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-extensions",
    ):
        options.add_argument(argument)
    # the console's messages (a CSP violation is one) for the test to read
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(executable_path=CHROMEDRIVER, log_output=str(tmp_path / "chromedriver.log"))
    driver = webdriver.Chrome(service=service, options=options)
    try:
        driver.set_page_load_timeout(WAIT_SECONDS)
        yield driver
    finally:
        driver.quit()


def shot(driver: WebDriver, tmp_path: Path, name: str) -> None:
    path = tmp_path / f"{name}.png"
    assert driver.save_screenshot(str(path)), name
    assert path.stat().st_size > 1000


def wait_text(driver: WebDriver, css: str, text: str) -> None:
    WebDriverWait(driver, WAIT_SECONDS).until(
        expected_conditions.text_to_be_present_in_element((By.CSS_SELECTOR, css), text)
    )


def confirm(driver: WebDriver, action: str) -> None:
    driver.find_element(By.ID, f"action-{action}").click()
    WebDriverWait(driver, WAIT_SECONDS).until(
        expected_conditions.presence_of_element_located((By.ID, "confirm"))
    )
    driver.find_element(By.ID, "confirm").click()


def test_console_in_chromium(pg_url: str, browser: WebDriver, tmp_path: Path) -> None:
    with Scheduler.open(pg_url) as sched, serving(sched) as server:
        seeded = seed(sched, "acme")
        base = server.url
        browser.get(base + "/ui/jobs")
        wait_text(browser, "h1", "Sign in")
        shot(browser, tmp_path, "signin")
        browser.find_element(By.ID, "token").send_keys(seeded.token)
        browser.find_element(By.ID, "signin").click()
        wait_text(browser, "h1", "Jobs")
        # console.js stored the browser's zone in a cookie (no inline script: CSP)
        WebDriverWait(browser, WAIT_SECONDS).until(lambda d: d.get_cookie("sd_tz") is not None)
        browser.find_element(By.ID, "q").send_keys("nightly")
        browser.find_element(By.ID, "search").click()
        wait_text(browser, "#jobs", "nightly-report")
        shot(browser, tmp_path, "jobs")

        browser.find_element(By.CSS_SELECTOR, "a.job-link").click()
        wait_text(browser, "#job-name", "nightly-report")
        assert browser.find_elements(By.CSS_SELECTOR, "#timeline rect.run-succeeded")
        assert browser.find_elements(By.CSS_SELECTOR, "#timeline rect.fire")
        wait_text(browser, "#runs", "missed by more than its grace period")
        shot(browser, tmp_path, "job")

        # the running run's page follows its output (console.js polls the fragment)
        browser.get(base + seeded.running_path)
        wait_text(browser, "#output", "step 1 of 3")
        wait_text(browser, "#run-status", "running")
        shot(browser, tmp_path, "run-running")
        finish_running(sched, seeded, "step 3 of 3: all done")
        wait_text(browser, "#output", "all done")
        wait_text(browser, "#run-status", "succeeded")
        shot(browser, tmp_path, "run-finished")

        browser.get(base + f"/ui/jobs/{seeded.job_id}")
        confirm(browser, "pause")
        wait_text(browser, "#job-status", "paused")
        assert sched.get_job(seeded.job_id).status.value == "paused"
        shot(browser, tmp_path, "job-paused")
        confirm(browser, "resume")
        wait_text(browser, "#job-status", "active")
        assert sched.get_job(seeded.job_id).status.value == "active"

        browser.get(base + "/ui/dead-letters")
        wait_text(browser, "#dead-letters", "worker said no")
        shot(browser, tmp_path, "dead-letters")
        browser.find_element(By.CSS_SELECTOR, "a.letter-link").click()
        confirm(browser, "replay")
        wait_text(browser, "#letter-state", "Replayed at")
        shot(browser, tmp_path, "dead-letter-replayed")

        for name, path, css in (
            ("late", "/ui/late", "#lateness"),
            ("workers", "/ui/workers", "#queues"),
            ("cluster", "/ui/cluster", "#cluster"),
        ):
            browser.get(base + path)
            WebDriverWait(browser, WAIT_SECONDS).until(
                expected_conditions.presence_of_element_located((By.CSS_SELECTOR, css))
            )
            shot(browser, tmp_path, name)

        # no script ran that the page did not ship: the CSP reported nothing
        errors_seen = [
            entry
            for entry in browser.get_log("browser")
            if "Content Security Policy" in entry.get("message", "")
        ]
        assert not errors_seen, errors_seen
        browser.find_element(By.ID, "signout").click()
        wait_text(browser, "h1", "Sign in")
    assert sorted(p.name for p in tmp_path.glob("*.png")) == sorted(
        f"{name}.png"
        for name in (
            "signin",
            "jobs",
            "job",
            "run-running",
            "run-finished",
            "job-paused",
            "dead-letters",
            "dead-letter-replayed",
            "late",
            "workers",
            "cluster",
        )
    )
