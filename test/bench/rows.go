package bench

import "encoding/json"

// rows is the table, in the order docs/BENCHMARKS.md shows it.
func rows() []row {
	return []row{
		kafkaTxRow(),
		kafkaBatchRow(),
		kafkaBatchNoPKRow(),
		kafkaOffsetsOnlyRow(),
		amqpTxRow(),
		amqpLeaseRow(),
		natsTxRow(),
		wmTxRow(),
		wmMemRow(),
		httpPgRow(),
		httpReplayRow(),
		pgtableRow(),
		sqltableMariaRow(),
		sqltablePgRow(),
		redisnxRow(),
		relayRow(pollRelay, rabbitTarget, 0.70),
		relayRow(pollRelay, kafkaTarget, 0.50),
		relayRow(walRelay, rabbitTarget, 0.90),
		relayRow(walRelay, kafkaTarget, 0.70),
	}
}

// payload is every message's body: an order, as JSON.
var payload = []byte(`{"amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}`)

// order is payload decoded: the work of the rows whose handler touches no
// database.
type order struct {
	Amount   int64  `json:"amount"`
	Currency string `json:"currency"`
	Customer string `json:"customer"`
}

func decodeOrder(b []byte) error {
	var o order
	return json.Unmarshal(b, &o)
}
