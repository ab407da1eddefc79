"""The dashboard in a real headless Chromium (Debian's chromium and chromium-driver,
driven by Selenium), against a real worker subprocess.

A person paged about parked charges opens the runs page, filters to parked, opens
one, reads its task timeline and error code, fixes the cause, presses Resume,
confirms, and watches the run reach SUCCEEDED as the worker executes it; then
cancels the rest of the group from the parked inbox. Read-only mode shows no
button. With `$WORKFLOW_DASHBOARD_SCREENSHOTS` set to a folder, the run page and
the inbox are saved there (README's pictures: `docs/`).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import wait_until
from worker_apps import dashboard_app
from worker_apps.ledger import URL_ENV

import workflow
from workflow import Status

waitress = pytest.importorskip("waitress")
pytest.importorskip("jinja2")
webdriver = pytest.importorskip("selenium.webdriver")

from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

from workflow.contrib.dashboard import make_app  # noqa: E402

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
APP = "tests.worker_apps.dashboard_app:registry"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)):
        reason = "Debian's chromium and chromium-driver are not installed (apt-get install)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--window-size=1280,900", "--disable-gpu"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.implicitly_wait(10)  # find_element waits for the next page's element
    yield driver
    driver.quit()


def _status(db: psycopg.Connection[Any], run_id: str) -> str:
    row = db.execute("SELECT status FROM workflow_runs WHERE id = %s", (run_id,)).fetchone()
    assert row is not None
    return str(row[0])


def _shoot(driver: Any, name: str) -> None:
    folder = os.environ.get("WORKFLOW_DASHBOARD_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(folder) / name))


def _until(driver: Any, what: str, check: Any, timeout: float = 30.0) -> None:
    """Reload until `check()` holds (the pages refresh themselves every few seconds;
    reloading sooner keeps the test short)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)
        driver.refresh()


def test_a_person_resumes_a_parked_run_and_cancels_the_rest_in_chromium(
    browser: Any, wsgi_server: Any, spawn: Any, db: psycopg.Connection[Any], engine_url: str,
    make_manager: Any, pool: Any, monkeypatch: Any,
) -> None:
    db.execute(dashboard_app.CREATE_TABLE)
    db.execute("INSERT INTO declined VALUES ('4000'), ('4001'), ('4002')")
    monkeypatch.setenv(URL_ENV, engine_url)
    worker = spawn(APP, "--poll-interval", "1")
    worker.wait_started()
    mgr = make_manager(dashboard_app.registry())
    with pool.connection() as conn, conn.transaction():
        runs = [dashboard_app.Charge_.start_tx(conn, mgr, dashboard_app.Charge(card, 1250))
                for card in ("4000", "4001", "4002", "4242")]
    wait_until(lambda: [_status(db, r.id) for r in runs] == ["parked"] * 3 + ["succeeded"],
               "the worker to park three charges", timeout=30)
    base = wsgi_server(make_app(pool))
    driver = browser

    driver.get(base + "/")
    assert driver.find_element(By.ID, "count-parked").text.split()[-1] == "3"
    Select(driver.find_element(By.ID, "filter-status")).select_by_value("parked")
    driver.find_element(By.ID, "filter-apply").click()
    WebDriverWait(driver, 10).until(lambda d: "status=parked" in d.current_url)
    rows = driver.find_elements(By.CSS_SELECTOR, "tr.run")
    assert len(rows) == 3 and {r.get_attribute("data-status") for r in rows} == {"parked"}
    first = runs[0].id
    driver.find_element(By.CSS_SELECTOR, f'a[href$="/runs/{first}"]').click()

    assert driver.find_element(By.ID, "run-status").text == "parked"
    assert driver.find_element(By.ID, "failure-code").text == "card.declined"
    tasks = driver.find_elements(By.CSS_SELECTOR, "tr.task")
    assert [t.get_attribute("data-state") for t in tasks] == ["done", "current"]
    assert "the issuer declined card 4000" in tasks[1].text
    _shoot(driver, "dashboard-run.png")

    db.execute("DELETE FROM declined WHERE card = '4000'")  # the cause is fixed
    driver.find_element(By.ID, "resume").click()
    driver.find_element(By.ID, "confirm")  # the confirmation page is up
    assert "fresh attempt budget" in driver.page_source
    driver.find_element(By.NAME, "reason").send_keys("issuer fixed the BIN range")
    driver.find_element(By.ID, "confirm").click()
    assert "resumed" in driver.find_element(By.ID, "done").text
    _until(driver, "the worker to finish the resumed run",
           lambda: driver.find_element(By.ID, "run-status").text == "succeeded")
    assert "issuer fixed the BIN range" in driver.find_element(By.ID, "history").text

    driver.get(base + "/parked")
    groups = driver.find_elements(By.CSS_SELECTOR, "tr.group")
    assert len(groups) == 1 and "card.declined" in groups[0].text
    _shoot(driver, "dashboard-parked.png")
    groups[0].find_element(By.CLASS_NAME, "cancel-all").click()
    WebDriverWait(driver, 10).until(lambda d: "/parked/confirm" in d.current_url)
    assert "Cancel 2 parked runs?" in driver.find_element(By.TAG_NAME, "h1").text
    driver.find_element(By.ID, "confirm").click()
    assert "cancelled 2 run(s)" in driver.find_element(By.ID, "done").text
    assert [_status(db, r.id) for r in runs] == ["succeeded", "cancelled", "cancelled",
                                                 "succeeded"]
    assert mgr.status(first).status is Status.SUCCEEDED


def test_read_only_mode_shows_no_button(
    browser: Any, wsgi_server: Any, make_manager: Any, pool: Any
) -> None:
    reg = workflow.Registry()
    flow = workflow.Workflow("Dash.Stuck", dashboard_app.Charge)

    def stuck(run: workflow.TaskRun[dashboard_app.Charge]) -> str:
        raise workflow.permanent(RuntimeError("stuck"))

    reg.register(workflow.define(flow, workflow.handle(workflow.Task("dash.stuck", str), stuck)))
    mgr = make_manager(reg)
    run = flow.start(mgr, dashboard_app.Charge("1", 1))
    assert run.wait(timeout=10) is Status.PARKED
    base = wsgi_server(make_app(pool, read_only=True))
    browser.get(f"{base}/runs/{run.id}")
    assert browser.find_element(By.ID, "run-status").text == "parked"
    browser.implicitly_wait(0)  # what must be absent is not waited for
    assert not browser.find_elements(By.ID, "resume")
    assert not browser.find_elements(By.ID, "cancel")
    assert not browser.find_elements(By.CSS_SELECTOR, "form[method=post]")
    browser.get(f"{base}/parked")
    assert not browser.find_elements(By.CLASS_NAME, "resume-all")
    assert "read-only" in browser.find_element(By.TAG_NAME, "header").text
    browser.get(f"{base}/runs/{run.id}/confirm?action=resume")
    assert not browser.find_elements(By.ID, "confirm")
    browser.implicitly_wait(10)
