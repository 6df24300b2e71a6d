-- The polling mode's earliest next request (docs/GITHUB.md, "Polling
-- set-up"). Released: never edit, add a new numbered file.
--
-- github_poll_cursors.next_poll_ms: no request for the workspace's events
-- before this time (X-Poll-Interval, X-RateLimit-Reset, Retry-After, a
-- failed poll's back-off), so a restarted scheduler does not ask GitHub
-- again while it is still limited. 0: at once.
-- last_event_id '0' means "listed, no event seen yet". Older cursors held ''
-- after an empty first poll, which read as "never listed" and made the next
-- poll only set the cursor, dropping its events: such rows become '0' (a
-- cursor row was only ever written after a listing that succeeded).
ALTER TABLE github_poll_cursors ADD COLUMN next_poll_ms BIGINT NOT NULL DEFAULT 0;
UPDATE github_poll_cursors SET last_event_id = '0' WHERE last_event_id = ''
