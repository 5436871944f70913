"""Tessera's Kubernetes API (group tessera.dev, version v1alpha1): typed models, the YAML loader and CRDs.

The three namespaced custom resources are ServingPool, LLMService and RequestClass.
Field names are snake_case in Python and camelCase in YAML/JSON.
"""

from tessera.api.base import API_VERSION, GROUP, VERSION, Condition, ObjectMeta, parse_quantity
from tessera.api.llm_service import LLMService, LLMServiceSpec, LLMServiceStatus
from tessera.api.loader import KINDS, Resource, SpecError, load_documents, parse_document
from tessera.api.request_class import RequestClass, RequestClassSpec, RequestClassStatus
from tessera.api.serving_pool import ServingPool, ServingPoolSpec, ServingPoolStatus

__all__ = [
    "API_VERSION",
    "GROUP",
    "KINDS",
    "VERSION",
    "Condition",
    "LLMService",
    "LLMServiceSpec",
    "LLMServiceStatus",
    "ObjectMeta",
    "RequestClass",
    "RequestClassSpec",
    "RequestClassStatus",
    "Resource",
    "ServingPool",
    "ServingPoolSpec",
    "ServingPoolStatus",
    "SpecError",
    "load_documents",
    "parse_document",
    "parse_quantity",
]
