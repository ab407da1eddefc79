from django.urls import path
from transfers import views

urlpatterns = [
    path("transfers", views.create_transfer),
    path("transfers/<int:pk>", views.show_transfer),
    path("metrics", views.metrics),
]
