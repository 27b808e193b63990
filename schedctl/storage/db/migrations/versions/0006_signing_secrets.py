"""Signing secrets: encrypted at rest like payloads, and rotated with a grace period.

Adds tenants.signing_secret_previous (the secret before the last rotation, which keeps
signing until signing_secret_previous_until). When payload keys are configured
(SCHEDULED_PAYLOAD_KEYS_FILE / SCHEDULED_PAYLOAD_KEYS, as for payloads) every plain
signing secret is encrypted here with the current key; without keys they stay plain, as
payloads do, and `schedctl db rotate-payload-key` encrypts them once keys are configured.

Revision ID: 0006
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from schedctl.core.crypto import is_encrypted
from schedctl.storage.db.types import UTCDateTime
from schedctl.storage.jobs.payloads import payload_cipher

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None
# the oldest daemons' revision that works on this schema (rule: storage/db/migrate.py);
# its own, as for every migration made before the rule: their daemons accepted only their own
compatible_with = "0006"


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("signing_secret_previous", sa.Text, nullable=True))
        batch.add_column(sa.Column("signing_secret_previous_until", UTCDateTime, nullable=True))
    # a bad key file fails the migration: better than leaving secrets plain while the
    # operator believes they are encrypted
    cipher = payload_cipher()
    if cipher is None:
        return
    tenants = sa.table(
        "tenants", sa.column("tenant_id", sa.String), sa.column("signing_secret", sa.Text)
    )
    connection = op.get_bind()
    rows = connection.execute(sa.select(tenants.c.tenant_id, tenants.c.signing_secret)).all()
    for tenant_id, stored in rows:
        if stored is None or is_encrypted(stored):
            continue
        connection.execute(
            sa.update(tenants)
            .where(tenants.c.tenant_id == tenant_id, tenants.c.signing_secret == stored)
            .values(signing_secret=cipher.encrypt(stored))
        )


def downgrade() -> None:
    # encrypted signing secrets stay encrypted: the previous schema's code reads them with
    # the same payload keys (the previous secret is dropped with its column)
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("signing_secret_previous_until")
        batch.drop_column("signing_secret_previous")
