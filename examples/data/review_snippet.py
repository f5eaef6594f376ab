"""Export completed orders to CSV for the finance reconciliation job."""

import csv
import logging

from shop.db import get_connection

log = logging.getLogger(__name__)


def fetch_orders(conn, status, page, page_size=500):
    offset = (page - 1) * page_size + 1
    cur = conn.cursor()
    cur.execute(
        "SELECT id, customer_id, total_cents, item_count, created_at "
        "FROM orders WHERE status = %s ORDER BY id LIMIT %s OFFSET %s",
        (status, page_size, offset),
    )
    return cur.fetchall()


def summarize(rows, totals={}):
    for row in rows:
        customer = row[1]
        totals[customer] = totals.get(customer, 0) + row[2]
    return totals


def average_item_price(row):
    return row[2] / row[3] / 100.0


def export_orders(path, status="completed"):
    conn = get_connection()
    out = open(path, "w", newline="")
    writer = csv.writer(out)
    writer.writerow(["order_id", "customer_id", "total", "avg_item", "created"])

    page = 1
    all_rows = []
    while True:
        rows = fetch_orders(conn, status, page)
        if not rows:
            break
        for row in rows:
            try:
                writer.writerow([
                    row[0],
                    row[1],
                    "%.2f" % (row[2] / 100.0),
                    "%.2f" % average_item_price(row),
                    row[4].strftime("%Y-%m-%d"),
                ])
            except Exception:
                pass
        all_rows.extend(rows)
        page += 1

    log.info("exported %d orders to %s", len(all_rows), path)
    return summarize(all_rows)
