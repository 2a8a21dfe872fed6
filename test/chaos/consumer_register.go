package chaos

// The cells and children of this helper's part of the matrix: consumer
// SIGKILLs (consumer_*.go), relay SIGKILLs (relay_*.go) and RabbitMQ faults
// (rabbit_*.go).
func init() {
	RegisterChild("kafka-consumer", kafkaChild)
	RegisterChild("amqp-consumer", amqpChild)
	RegisterChild("watermill-consumer", wmChild)
	RegisterChild("http-server", httpChild)
	RegisterChild("relay", relayChild)
	RegisterChild("kafka-sqltable-consumer", kafkaSQLChild)
	Register(kafkaSQLCell("kafka/" + storeMySQL + "/sigkill"))
	Register(relayKafkaCell("relay/kafka/sigkill"))
	Register(relayAMQPCell("relay/amqp/sigkill"))
	Register(rabbitAMQPCell("rabbit/amqp/close-all+stop-app"))
	Register(rabbitRelayCell("rabbit/relay/close-all+stop-app"))
	registerPartition()
	for _, store := range []string{storePG, storeRedis} {
		Register(kafkaCell("kafka/"+store+"/sigkill", store))
		Register(amqpCell("amqp/"+store+"/sigkill", store))
		Register(wmCell("watermill/"+store+"/sigkill", store))
		Register(httpCell("http/"+store+"/sigkill", store))
	}
}
