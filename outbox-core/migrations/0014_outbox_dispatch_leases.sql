-- Dispatcher leases: a dispatcher claims an action by marking it with a lease and committing,
-- calls the API outside any transaction, and records the answer fenced by that lease. So a
-- slow call holds only its own key (no transaction, no row or advisory lock stays open across
-- it), and an action whose dispatcher died mid-call becomes claimable again once its lease
-- (`next_attempt_at`) has passed, with the same idempotency key.
--
-- `lease`: the claim that holds the row while its call runs; NULL otherwise. A record whose
-- lease no longer matches (another dispatcher took the action over) changes nothing.
-- `calls`: calls made that may have applied the action (sent, whatever came back). An action
-- given up with `calls = 0` was never sent, so the agent may decide again; with `calls > 0`
-- its effect is unknown until the API is asked.
--
-- Both columns change only the catalog (a constant default), but need a lock that waits for
-- every relay batch in flight while enqueues queue behind it: give up after a few seconds
-- instead (rolled back as a whole) and run the migration again.
SET LOCAL lock_timeout = '5s';

ALTER TABLE outbox_events ADD COLUMN IF NOT EXISTS lease UUID;
ALTER TABLE outbox_events ADD COLUMN IF NOT EXISTS calls INTEGER NOT NULL DEFAULT 0;
