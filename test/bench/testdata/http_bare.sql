-- The baseline of the HTTP path on pgtable: the handler's own transaction
-- inserting the payment and reading its id back.
\set k random(1, 4000000000000000000)
BEGIN;
INSERT INTO floor_payments_bare (amount, currency, customer) VALUES (4200, 'EUR', 'cus_' || :k::text) RETURNING id;
COMMIT;
